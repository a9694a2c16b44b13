"""gloo groups across nodes when only NCCL was told its interface (review 2026-11-25-gpu-readiness
#18): checkpoint.async's group and the CPU part of the mixed backend (cpu_offload) warn once per
node, naming the variable to set and its value for this host's interfaces."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from disttrain import traps
from disttrain.checkpoint.manager import Checkpointer, ModelState
from disttrain.config.schema import CheckpointConfig
from disttrain.dist import DistEnv, init_process_group
from disttrain.engine.state import TrainState
from disttrain.strategies.base import Strategy
from disttrain.strategies.specs.data_parallel import SingleStrategyConfig
from disttrain.traps import gloo_across_nodes

NICS = ["lo", "docker0", "eth0", "ib0", "ib1"]


@pytest.mark.parametrize(
    ("nccl", "hint"),
    [
        ("ib", "GLOO_SOCKET_IFNAME=ib0,ib1"),
        ("^docker,lo", "GLOO_SOCKET_IFNAME=eth0,ib0,ib1"),
        ("eth0", "GLOO_SOCKET_IFNAME=eth0"),
    ],
)
def test_warns_with_gloos_exact_names(nccl: str, hint: str) -> None:
    warning = gloo_across_nodes("checkpoint.async's group", 2, {"NCCL_SOCKET_IFNAME": nccl}, NICS)
    assert warning is not None
    assert f"NCCL_SOCKET_IFNAME={nccl} is set but GLOO_SOCKET_IFNAME is not" in warning
    assert "spans 2 nodes" in warning and f"HINT: export {hint} on every node" in warning


def test_silent_on_one_node_or_when_gloo_is_told_or_nccl_is_not() -> None:
    assert gloo_across_nodes("g", 1, {"NCCL_SOCKET_IFNAME": "ib"}, NICS) is None
    assert gloo_across_nodes("g", 4, {"NCCL_SOCKET_IFNAME": "ib", "GLOO_SOCKET_IFNAME": "ib0"}, NICS) is None
    assert gloo_across_nodes("g", 4, {}, NICS) is None


def _async_checkpointer(tmp_path: Path, env: DistEnv, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    made: list[Any] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "new_group", lambda **kw: made.append(kw))
    model = nn.Linear(2, 2)
    states = {"model": ModelState(Strategy(SingleStrategyConfig(), env), model, torch.optim.SGD(model.parameters())),
              "train": TrainState()}  # fmt: skip
    cfg = CheckpointConfig()
    setattr(cfg, "async", True)
    Checkpointer(cfg, tmp_path, env, states)  # type: ignore[arg-type]
    return made


@pytest.mark.parametrize(("world", "local", "warned"), [(4, 2, True), (2, 2, False)])
def test_async_checkpoint_group_warns_on_several_nodes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    world: int,
    local: int,
    warned: bool,
) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    env = DistEnv(0, 0, world, local, "nccl", torch.device("cuda", 0))
    with caplog.at_level(logging.WARNING, logger="disttrain"):
        made = _async_checkpointer(tmp_path, env, monkeypatch)
    assert made == [{"backend": "gloo"}]
    hits = [r.message for r in caplog.records if "GLOO_SOCKET_IFNAME is not" in r.message]
    assert bool(hits) == warned
    if warned:
        assert "checkpoint.async's group spans 2 nodes" in hits[0] and "GLOO_SOCKET_IFNAME=lo" in hits[0]


def test_mixed_backend_warns_on_several_nodes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: None)
    env = DistEnv(8, 0, 16, 8, "nccl", torch.device("cuda", 0))
    with caplog.at_level(logging.WARNING, logger="disttrain"):
        init_process_group(env, 30.0, cpu_collectives=False)
        assert not caplog.records
        init_process_group(env, 30.0, cpu_collectives=True)
    assert "the default group's gloo part (CPU tensors) spans 2 nodes" in caplog.records[0].message
    assert traps.warn_gloo_across_nodes("x", 8, 8) is None  # one node
