"""The default group's backend string (review 2026-11-25-gpu-readiness #4): FSDP's cpu_offload runs
collectives on CPU tensors (grad norm, full state dict), which an NCCL-only group refuses at step 1;
such runs get torch's mixed `cuda:nccl,cpu:gloo`. The strategy spec decides, not dist.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from disttrain.config import compose, resolve
from disttrain.config.run import Run
from disttrain.dist import DistEnv, group_backend, init_process_group
from disttrain.strategies import specs


def _backend(monkeypatch: pytest.MonkeyPatch, backend: str, cfg: dict[str, Any]) -> str:
    """The backend string init_process_group hands torch for a rank of this run config."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    env = DistEnv(0, 0, 1, 1, backend, device)
    init_process_group(env, 30.0, cpu_collectives=specs.cpu_collectives(Run.of(cfg)))
    return str(seen["backend"])


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp", "zero2"])
def test_cpu_offload_on_nccl_gets_gloo_for_cpu_tensors(
    monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    overrides = [f"strategy={strategy}", "strategy.cpu_offload=true"]
    offload = resolve(compose(overrides), overrides)  # the composed run config, as a rank reads it
    assert _backend(monkeypatch, "nccl", offload) == "cuda:nccl,cpu:gloo"
    assert _backend(monkeypatch, "gloo", offload) == "gloo"
    kept = {**offload, "strategy": {**offload["strategy"], "cpu_offload": False}}
    assert _backend(monkeypatch, "nccl", kept) == "nccl"


def test_other_strategies_keep_plain_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    for strategy in ("ddp", "zero", "tp", "fsdp+tp", "pipeline"):
        overrides = [f"strategy={strategy}"]
        assert _backend(monkeypatch, "nccl", resolve(compose(overrides), overrides)) == "nccl"
    assert group_backend("nccl", cpu_collectives=True) == "cuda:nccl,cpu:gloo"
    assert group_backend("gloo", cpu_collectives=True) == "gloo"


def test_one_process_with_only_master_addr_needs_no_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-rank job of launcher=slurm: the job script exports MASTER_ADDR (for torchrun's nodes)
    and no MASTER_PORT; the rank runs in the node launcher's process and must not read env://
    (it failed with "MASTER_PORT expected, but not set")."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    init_process_group(DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu")), 30.0)
    assert isinstance(seen.get("store"), dist.HashStore) and seen["world_size"] == 1
