"""Specs of the replicated data-parallel family: single, ddp, dp (nn.DataParallel), zero, localsgd.

Every rank (or the one process) holds the whole model; batches are split across the replicas.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from disttrain.config.common import Choice, world_shape
from disttrain.config.common import help_field as h
from disttrain.config.errors import ConfigError
from disttrain.strategies.specs.core import (
    PlanRow,
    PlanShape,
    StrategyConfig,
    StrategySpec,
    at_least,
    data_parallel_row,
    register,
)
from disttrain.strategies.specs.layout import Layout

if TYPE_CHECKING:
    from disttrain.config.run import Run

log = logging.getLogger("disttrain")


class CommHook(Choice):
    """DDP's gradient compression hooks (torch.distributed.algorithms.ddp_comm_hooks.default_hooks)."""

    fp16 = "fp16"
    bf16 = "bf16"


@dataclass
class SingleStrategyConfig(StrategyConfig):
    name: str = "single"


@dataclass
class DPStrategyConfig(StrategyConfig):
    name: str = "dp"


@dataclass
class DDPStrategyConfig(StrategyConfig):
    name: str = "ddp"
    bucket_cap_mb: float = h("DDP gradient bucket size in MiB", 25.0)
    find_unused_parameters: bool = h("tolerate parameters that get no gradient (slower)", False)
    static_graph: bool = h("promise the graph is the same every step (enables optimisations)", False)
    gradient_as_bucket_view: bool = h("let gradients alias the all-reduce buckets (saves memory)", False)
    comm_hook: CommHook | None = h("gradient compression hook: null, fp16 or bf16", None)
    sync_batchnorm: bool = h(
        "convert BatchNorm layers to SyncBatchNorm (statistics over the global batch; CUDA only)", False
    )


@dataclass
class ZeroStrategyConfig(DDPStrategyConfig):
    name: str = "zero"
    parameters_as_bucket_view: bool = h("ZeRO: pack params into contiguous buckets per rank", False)


@dataclass
class LocalSGDStrategyConfig(DDPStrategyConfig):
    name: str = "localsgd"
    sync_every: int = h("average parameters across ranks every N optimizer steps (1: every step)", 4)
    warmup_steps: int = h("plain DDP steps (gradients all-reduced) before local SGD starts", 0)


# ------------------------------------------------------------------------------------------ checks
def check_single(run: Run, s: SingleStrategyConfig) -> None:
    if run.world.size != 1:
        raise ConfigError(
            "strategy",
            s.name,
            f"world size 1 (nodes x nproc_per_node is {run.world.nodes} x {run.world.nproc_per_node})",
            f"use nproc_per_node=1 with strategy={s.name}, or strategy=ddp for several ranks.",
        )


def check_dp(run: Run, s: DPStrategyConfig) -> None:
    if run.world.size != 1:
        raise ConfigError(
            "nproc_per_node",
            run.world.nproc_per_node,
            f"1 with strategy={s.name} (world size is {world_shape(run)})",
            "nn.DataParallel drives every local GPU from ONE process: set nproc_per_node=1 nodes=1; "
            "for one process per GPU use strategy=ddp.",
        )


def warn_single_rank(run: Run, name: str) -> None:
    if run.world.size < 2:
        log.warning(
            "strategy=%s on world size 1 (%s): nothing is sharded or averaged", name, world_shape(run)
        )


def check_ddp(run: Run, s: DDPStrategyConfig) -> None:
    if s.comm_hook == "bf16" and run.backend.name == "gloo":
        raise ConfigError(
            "strategy.comm_hook",
            "bf16",
            "null or fp16 with backend=gloo",
            "PyTorch's bf16_compress_hook needs NCCL (CUDA); on gloo use strategy.comm_hook=fp16.",
        )
    if s.bucket_cap_mb is None or s.bucket_cap_mb <= 0:
        raise ConfigError("strategy.bucket_cap_mb", s.bucket_cap_mb, "a number > 0", "25 MiB suits most.")
    if s.sync_batchnorm and run.backend.name == "gloo":
        refuse_sync_batchnorm("backend=gloo (CPU tensors)")


def refuse_sync_batchnorm(where: str) -> None:
    raise ConfigError(
        "strategy.sync_batchnorm",
        True,
        f"false with {where}",
        "torch's SyncBatchNorm runs on CUDA devices only (nccl). On CPU ranks leave it false: "
        "BatchNorm then normalises each rank's batch, and disttrain averages the running "
        "statistics across ranks before every validation and save (docs/strategies.md, BatchNorm).",
    )


def check_ddp_model(run: Run, s: DDPStrategyConfig, model: Any, gpus: int) -> None:
    """With the machine: PyTorch's bf16 compression hook and SyncBatchNorm need NCCL, so CUDA GPUs."""
    if s.sync_batchnorm and gpus == 0:
        refuse_sync_batchnorm("no CUDA GPUs on this machine")
    if s.comm_hook == "bf16" and gpus == 0:
        raise ConfigError(
            "strategy.comm_hook",
            "bf16",
            "null or fp16 on this machine (no CUDA GPUs, so the backend is gloo)",
            "PyTorch's bf16_compress_hook needs NCCL (CUDA); use strategy.comm_hook=fp16.",
        )


def check_zero(run: Run, s: ZeroStrategyConfig) -> None:
    warn_single_rank(run, s.name)
    check_ddp(run, s)


def check_localsgd(run: Run, s: LocalSGDStrategyConfig) -> None:
    warn_single_rank(run, s.name)
    check_ddp(run, s)
    at_least("sync_every", s.sync_every, 1, "1 averages every step (equals ddp); 4-16 saves bandwidth.")
    at_least(
        "warmup_steps", s.warmup_steps, 0, "0 starts local SGD at once; some DDP steps first often help."
    )
    if s.comm_hook is not None:
        raise ConfigError(
            "strategy.comm_hook",
            s.comm_hook,
            f"null with strategy={s.name}",
            "local SGD registers its own DDP comm hook (post_localSGD_hook); DDP takes only one.",
        )


# ------------------------------------------------------------------------------------------ plan
def plan_ddp(shape: PlanShape) -> list[PlanRow]:
    return [data_parallel_row("ddp", shape, preference=10, note="full replica per rank")]


def plan_zero(shape: PlanShape) -> list[PlanRow]:
    note = "ZeRO-1: optimizer state sharded; same traffic as ddp"
    return [data_parallel_row("zero", shape, preference=20, zero=1, note=note)]


def zero_layout(s: ZeroStrategyConfig, world: int) -> Layout:
    """Whole parameters on every rank, the optimizer state sharded across all of them (ZeRO-1)."""
    return Layout(world, dp_shard=world, zero=1)


# ------------------------------------------------------------------------------------------ specs
SINGLE = register(
    StrategySpec(
        name="single",
        peft=True,
        config=SingleStrategyConfig,
        target="disttrain.strategies.single:SingleStrategy",
        replicated=True,
        check_static=check_single,
        oom_retry=True,
    )
)
DDP = register(
    StrategySpec(
        name="ddp",
        peft=True,
        config=DDPStrategyConfig,
        target="disttrain.strategies.ddp:DDPStrategy",
        replicated=True,
        check_static=check_ddp,
        check_model=check_ddp_model,
        plan=plan_ddp,
    )
)
DP = register(
    StrategySpec(
        name="dp",
        config=DPStrategyConfig,
        target="disttrain.strategies.dp:DPStrategy",
        amp=frozenset(),
        replicated=True,
        check_static=check_dp,
        oom_retry=True,
    )
)
ZERO = register(
    StrategySpec(
        name="zero",
        config=ZeroStrategyConfig,
        dcp_layout=False,
        target="disttrain.strategies.zero:ZeroStrategy",
        amp=frozenset({"bf16"}),
        replicated=True,
        check_static=check_zero,
        check_model=check_ddp_model,
        layout=zero_layout,
        plan=plan_zero,
    )
)
LOCALSGD = register(
    StrategySpec(
        name="localsgd",
        config=LocalSGDStrategyConfig,
        dcp_layout=False,
        target="disttrain.strategies.localsgd:LocalSGDStrategy",
        amp=frozenset({"bf16"}),
        check_static=check_localsgd,
        check_model=check_ddp_model,
    )
)
