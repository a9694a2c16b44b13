"""Review 2026-11-28-reliability D5: an `init.path` .pt whose zip records are deflated was memory-
mapped record by record, so the compressed bytes became the weights (val/loss NaN, exit 0)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from disttrain.checkpoint import init_from
from disttrain.config.errors import ConfigError
from disttrain.config.schema import InitConfig
from disttrain.config.typed import typed


def test_d5_a_deflated_pt_is_refused_not_loaded_as_compressed_bytes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    plain, bomb = tmp_path / "plain.pt", tmp_path / "bomb.pt"
    torch.save({"model": source.state_dict()}, plain)
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    loaded = torch.load(bomb, weights_only=True)["model"]  # torch itself inflates it correctly
    assert all(torch.equal(loaded[k], v) for k, v in source.state_dict().items())
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as info:
        init_from.apply(typed(InitConfig, {"path": str(bomb)}), model, is_zero=True)
    assert info.value.key == "init.path" and info.value.value == str(bomb)
    assert "is compressed" in info.value.hint and "save it again with torch.save" in info.value.hint
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # nothing copied in
    init_from.apply(typed(InitConfig, {"path": str(plain)}), model, is_zero=True)  # the stored one loads
    assert all(torch.equal(model.state_dict()[k], v) for k, v in source.state_dict().items())
