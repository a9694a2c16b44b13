"""`disttrain plan` numbers against hand computation (ZeRO paper bytes, Korthikanti activations)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disttrain.config import compose, resolve
from disttrain.config.run import Run
from disttrain.tools.planner import GIB, activation_bytes, plan, precision

# The default MLP on digits: 64 -> 128 -> 128 -> 10, weights + biases.
MLP_PARAMS = 64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10  # 26,122


def _cfg(*overrides: str) -> dict:
    return resolve(compose(list(overrides)))


def _rows(result: dict) -> dict[str, dict]:
    return {r["layout"]: r for r in result["layouts"]}


def test_mlp_fp32_adamw_per_rank_bytes_by_hand() -> None:
    result = plan(Run.of(_cfg("nproc_per_node=2", "optim=adamw")))
    assert result["model"]["params"] == MLP_PARAMS == 26122
    pr = result["precision"]
    assert (pr["params"], pr["grads"], pr["optimizer_bytes"]) == (4, 4, 8)  # fp32 Adam: 2 states
    rows = _rows(result)
    n, psi = 2, MLP_PARAMS
    assert (
        rows["ddp"]["bytes"]["params"] + rows["ddp"]["bytes"]["grads"] + rows["ddp"]["bytes"]["optimizer"]
        == 16 * psi
    )
    assert rows["zero"]["bytes"]["optimizer"] == 8 * psi / n and rows["zero"]["bytes"]["grads"] == 4 * psi
    assert rows["zero2"]["bytes"]["grads"] == 4 * psi / n and rows["zero2"]["bytes"]["params"] == 4 * psi
    assert rows["fsdp"]["bytes"]["params"] == 4 * psi / n
    # activations: a forward on meta sums leaf outputs: input 64 + flatten 64 + 4 x 128 + 10, x batch 32, x 4 B
    assert result["activations"]["bytes"] == 32 * (64 + 64 + 4 * 128 + 10) * 4
    assert rows["ddp"]["fits"] and result["recommendation"]["layout"] == "ddp"


def test_zero_paper_mixed_precision_adam_is_2_2_12() -> None:
    cfg = _cfg()
    cfg["amp"] = {"name": "bf16", "dtype": "bfloat16"}
    pr = precision(Run.of(cfg))
    assert (pr["params"], pr["grads"], pr["optimizer_bytes"]) == (2, 2, 12) and pr["activation"] == 2
    cfg["optim"] = {"_target_": "torch.optim.SGD", "momentum": 0.9}
    assert precision(Run.of(cfg))["optimizer_bytes"] == 8  # fp32 master + momentum


def test_transformer_activations_korthikanti_by_hand() -> None:
    cfg = _cfg()
    cfg["model"] = {"n_layer": 2, "d_model": 4096, "n_head": 32, "seq_len": 1024, "vocab_size": 0}
    act, how, layers = activation_bytes(Run.of(cfg), None, batch=4, act_bytes=2, ckpt=False)
    # s b h (34 + 5 a s / h) per layer: 1024 * 4 * 4096 * (34 + 5 * 32 * 1024 / 4096) = 16,777,216 * 74
    assert act == 2 * 16_777_216 * 74 and layers == 2 and "Korthikanti" in how
    act_ckpt, _, _ = activation_bytes(Run.of(cfg), None, batch=4, act_bytes=2, ckpt=True)
    assert act_ckpt == 2 * (2 * 16_777_216) + 16_777_216 * 74  # inputs kept + one layer recomputed


STAND_IN = """
from torch import nn


def linear(in_features, out_features, n_layer, d_model, n_head, seq_len):
    return nn.Linear(in_features, out_features)
"""


def test_gpt_like_plan_sharding_and_recommendation(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 4096 x 4096 Linear stands in for the weights; the transformer fields drive activations.

    The stand-in takes those fields as arguments: _target_ keys are strict (no silent drops)."""
    (tmp_path / "planstandin.py").write_text(STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _cfg(
        "nodes=2", "nproc_per_node=4", "master_addr=10.0.0.1", "plan.micro_batch=1", "plan.gpu_mem_gb=0.3"
    )
    cfg["model"] = {
        "_target_": "planstandin.linear",
        "in_features": 4096,
        "out_features": 4096,
        "n_layer": 8,
        "d_model": 512,
        "n_head": 8,
        "seq_len": 256,
    }
    result = plan(Run.of(cfg))
    psi = 4096 * 4096 + 4096
    rows = _rows(result)
    assert result["model"]["params"] == psi
    assert rows["fsdp"]["bytes"]["params"] == pytest.approx(4 * psi / 8)
    assert rows["hsdp"]["bytes"]["params"] == pytest.approx(4 * psi / 4)  # sharded over the 4 local ranks
    assert rows["tp"]["bytes"]["activations"] == pytest.approx(
        result["activations"]["bytes"] / 8
    )  # all ranks
    assert rows["fsdp+tp"]["bytes"]["activations"] == pytest.approx(result["activations"]["bytes"] / 4)
    assert {"fsdp+tp", "pipeline"} <= set(rows) and rows["pipeline"]["pp"] == 8
    # every layout is one a `strategy=` runs: its name is a strategy option, its `run` the overrides
    from disttrain.config import config_dir

    options = {p.stem for p in (config_dir() / "strategy").glob("*.yaml")}
    assert set(rows) <= options and all(r["run"].startswith(f"strategy={r['layout']}") for r in rows.values())
    # activations, fp32: 8 layers x 256 x 512 x (34 + 5 x 8 x 256 / 512) x 2 = 113,246,208 B
    assert result["activations"]["bytes"] == 8 * 256 * 512 * 54 * 2
    # usable 0.27 GiB = 289.9 MB. ddp: 16 B x psi = 268.5 MB + 113.2 MB: no.
    # zero (ZeRO-1): (4 + 4 + 8 / 8) B x psi = 151.0 MB + 113.2 MB = 264.2 MB: yes, and first in preference.
    assert not rows["ddp"]["fits"] and rows["zero"]["fits"]
    rec = result["recommendation"]
    assert (
        rec["layout"] == "zero" and "a full replica needs" in rec["reason"] and rec["run"] == "strategy=zero"
    )
    json.dumps(result)  # JSON-ready


def test_nothing_fits_says_so_with_a_hint() -> None:
    result = plan(Run.of(_cfg("plan.gpu_mem_gb=0.00001")))
    assert result["recommendation"]["layout"] is None
    assert "HINT" in result["recommendation"]["reason"]
    assert result["usable_bytes"] == pytest.approx(0.00001 * GIB * 0.9)


def test_plan_of_four_nodes_needs_no_launch_settings(capsys: pytest.CaptureFixture[str]) -> None:
    """A planning tool asks for no master_addr: `plan model=gpt nodes=4 nproc_per_node=8` prints."""
    from disttrain.tools.plan_command import cmd_plan

    assert cmd_plan(["model=gpt", "nodes=4", "nproc_per_node=8"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich folds lines at its console's width
    assert "4 node(s) x 8 = 32 ranks" in out and "recommended:" in out and "master_addr" not in out
