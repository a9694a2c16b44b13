"""debug.check_sync_every compares buffers too (review 2026-11-28-real-workloads F1): every buffer a
replica must hold like the others, but not BatchNorm's running statistics, which each replica
updates from its own batches until a validation or save averages them (Strategy.sync_buffers)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from disttrain.config.schema import DebugConfig
from disttrain.dist import DistEnv
from disttrain.engine.guards import DesyncError, Guards
from disttrain.strategies import build_strategy

ENV = DistEnv(0, 0, 2, 2, "gloo", torch.device("cpu"))  # rank 0 of two; the peer's sums are handed in


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.ones(4))  # not a statistic: replicas must agree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x)) * self.scale


def _check(mine: nn.Module, peer: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """check_sync on rank 0 holding `mine`, with rank 1's checksums computed from `peer`."""
    strategy = build_strategy({"name": "ddp"}, ENV)
    sums: list[torch.Tensor] = []

    def capture(out: list[torch.Tensor], tensor: torch.Tensor, *_: Any, **__: Any) -> None:
        sums.append(tensor.clone())
        for slot in out:
            slot.copy_(tensor)

    monkeypatch.setattr(dist, "all_gather", capture)
    Guards("off", DebugConfig(check_sync_every=1), ENV, strategy.precision, strategy, peer).check_sync(1)
    (peer_sums,) = sums

    def with_peer(out: list[torch.Tensor], tensor: torch.Tensor, *_: Any, **__: Any) -> None:
        out[0].copy_(tensor)
        out[1].copy_(peer_sums)

    monkeypatch.setattr(dist, "all_gather", with_peer)
    Guards("off", DebugConfig(check_sync_every=1), ENV, strategy.precision, strategy, mine).check_sync(7)


def test_check_sync_names_a_diverged_buffer_and_ignores_running_statistics(
    monkeypatch: pytest.MonkeyPatch, one_rank: None
) -> None:
    torch.manual_seed(0)
    model = Net()
    model(torch.randn(8, 3))  # running statistics and the batch counter move
    peer = copy.deepcopy(model)
    with torch.no_grad():
        peer.bn.running_mean.add_(0.5)
        peer.bn.running_var.mul_(2.0)
    _check(model, peer, monkeypatch)  # statistics differ between syncs by design: no error

    for name in ("bn.num_batches_tracked", "scale"):
        peer = copy.deepcopy(model)
        with torch.no_grad():
            peer.get_buffer(name).add_(1)
        with pytest.raises(DesyncError) as info:
            _check(model, peer, monkeypatch)
        assert f"buffers diverged across ranks at step 7: first diverged buffer {name!r}" in str(info.value)
        assert "ranks [1] differ from rank 0" in str(info.value)
