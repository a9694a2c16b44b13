"""The strict-device harness (tests/strict_device.py) and the default-group collective call sites it
guards: a CPU tensor there fails as under NCCL (review 2026-11-25-gpu-readiness, #3 and section 3.2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from strict_device import NCCL_CPU_ERROR, past_collectives, strict_world


def test_harness_refuses_cpu_tensors_like_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    with strict_world(4, rank=2, monkeypatch=monkeypatch) as env:
        assert env.device.type == "meta" and env.world_size == 4
        dist.all_reduce(torch.ones(3, device=env.device))
        dist.barrier()  # on the bound device, as NCCL's barrier
        with pytest.raises(RuntimeError, match=NCCL_CPU_ERROR):
            dist.all_reduce(torch.ones(3))
        with pytest.raises(RuntimeError, match=NCCL_CPU_ERROR):
            dist.all_gather([torch.ones(3, device=env.device)] * 4, torch.ones(3))
        out: list[object] = [None] * 4
        dist.all_gather_object(out, {"rank": 2})
        assert out == [{"rank": 2}] * 4
    assert not dist.is_initialized()
    assert "meta" not in dist.Backend.default_device_backend_map  # no leftover for other tests


def test_past_collectives_counts_until_a_meta_read(monkeypatch: pytest.MonkeyPatch) -> None:
    with strict_world(2, monkeypatch=monkeypatch) as env:

        def reads_back() -> float:
            t = torch.ones(1, device=env.device)
            dist.all_reduce(t)
            dist.all_reduce(t)
            return float(t.item())

        assert past_collectives(reads_back, monkeypatch) == 2

        def stray_cpu() -> None:
            dist.all_reduce(torch.ones(1, device=env.device))
            dist.all_reduce(torch.ones(1))

        with pytest.raises(RuntimeError, match=NCCL_CPU_ERROR):
            past_collectives(stray_cpu, monkeypatch)


def test_any_rank_guards_and_summary_use_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call sites the review found right stay right: each reaches its collective with a tensor
    on env.device (NCCL's GPU) and fails only where it reads the (data-less) result back."""
    from types import SimpleNamespace

    from disttrain.checkpoint.manager import Checkpointer
    from disttrain.config.schema import DebugConfig
    from disttrain.engine.guards import Guards
    from disttrain.strategies import build_strategy

    with strict_world(2, rank=1, monkeypatch=monkeypatch) as env:
        assert (
            past_collectives(lambda: Checkpointer._any_rank(SimpleNamespace(env=env), True), monkeypatch) == 1
        )
        strategy = build_strategy({"name": "ddp"}, env)
        model = torch.nn.Linear(3, 2)
        guards = Guards("skip", DebugConfig(check_sync_every=1), env, strategy.precision, strategy, model)
        loss, norm = (
            torch.tensor(float("nan")),
            torch.tensor(1.0),
        )  # as the step hands them over (host values)
        assert past_collectives(lambda: guards.after_backward(3, loss, norm), monkeypatch) == 1
        assert past_collectives(lambda: guards.check_sync(3), monkeypatch) == 1
        stats = strategy.summary_stats(model, torch.optim.SGD(model.parameters()))  # object collective
        assert stats["state_bytes_by_rank"] == [2 * 8 * 4] * 2  # params + grads of 8 floats, mirrored
        assert (
            past_collectives(lambda: strategy.all_reduce(torch.ones((), device=env.device)), monkeypatch) == 1
        )


def test_model_parallel_collectives_use_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """fsdp+tp's data-parallel all-reduce (on its dp sub-mesh), the pipeline's sum over stages and
    its point-to-point header and payload: all on the device."""
    from torch.distributed.device_mesh import init_device_mesh

    from disttrain.strategies import build_strategy
    from disttrain.strategies.pipeline import _recv, _send

    with strict_world(4, rank=3, monkeypatch=monkeypatch) as env:
        tp = build_strategy({"name": "fsdp+tp", "tp_degree": 2, "param_dtype": "float32"}, env)
        tp.mesh = init_device_mesh(env.device.type, (2, 2), mesh_dim_names=("dp", "tp"))  # type: ignore[attr-defined]
        assert past_collectives(lambda: tp.all_reduce(torch.ones((), device=env.device)), monkeypatch) == 1
        with pytest.raises(RuntimeError, match=NCCL_CPU_ERROR):
            tp.all_reduce(torch.ones(()))  # what the harness exists for, on a sub-mesh too
        pipe = build_strategy({"name": "pipeline"}, env)
        assert past_collectives(lambda: pipe.all_reduce(torch.ones((), device=env.device)), monkeypatch) == 1
        _send(torch.ones(2, 3, device=env.device), 0)
        with pytest.raises(
            RuntimeError, match="meta"
        ):  # the header arrived on the device; reading it stops here
            _recv(2, env.device)
