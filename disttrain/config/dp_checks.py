"""Pre-launch checks for the data-parallel family (dp, ddp, zero, localsgd, fsdp/hsdp), with numbers.

`check_static` needs only the resolved config (no torch); `check_runtime` also knows the GPU count
and the model built on the meta device. Both raise ConfigError; validate.py calls them.
"""

from __future__ import annotations

import logging
from typing import Any

from disttrain.config.errors import ConfigError, check_divides, one_of

DDP_FAMILY = ("ddp", "zero", "localsgd")
COMM_HOOKS = (None, "fp16", "bf16")
DTYPES = ("float32", "bfloat16", "float16")

log = logging.getLogger("disttrain")


def _world(cfg: dict[str, Any]) -> tuple[int, str]:
    ws = int(cfg["nodes"]) * int(cfg["nproc_per_node"])
    return ws, f"nodes x nproc_per_node = {cfg['nodes']} x {cfg['nproc_per_node']} = {ws}"


def _int_at_least(cfg: dict[str, Any], key: str, low: int, hint: str) -> int:
    value = cfg["strategy"].get(key)
    if value is None or value < low:
        raise ConfigError(f"strategy.{key}", value, f"an integer >= {low}", hint)
    return int(value)


def check_static(cfg: dict[str, Any]) -> None:
    name, s = cfg["strategy"]["name"], cfg["strategy"]
    ws, shape = _world(cfg)
    if name == "dp" and ws != 1:
        raise ConfigError(
            "nproc_per_node",
            cfg["nproc_per_node"],
            f"1 with strategy=dp (world size is {shape})",
            "nn.DataParallel drives every local GPU from ONE process: set nproc_per_node=1 nodes=1; "
            "for one process per GPU use strategy=ddp.",
        )
    if name in ("zero", "fsdp", "localsgd") and ws < 2:
        log.warning("strategy=%s on world size 1 (%s): nothing is sharded or averaged", name, shape)
    if name in DDP_FAMILY:
        hook = s.get("comm_hook")
        if hook not in COMM_HOOKS:
            raise ConfigError(
                "strategy.comm_hook", hook, one_of(("null", "fp16", "bf16")), "fp16/bf16 halve the bytes."
            )
        if hook == "bf16" and cfg["backend"]["name"] == "gloo":
            raise ConfigError(
                "strategy.comm_hook",
                "bf16",
                "null or fp16 with backend=gloo",
                "PyTorch's bf16_compress_hook needs NCCL (CUDA); on gloo use strategy.comm_hook=fp16.",
            )
        if s.get("bucket_cap_mb") is None or s["bucket_cap_mb"] <= 0:
            raise ConfigError(
                "strategy.bucket_cap_mb", s.get("bucket_cap_mb"), "a number > 0", "25 MiB suits most."
            )
    if name == "fsdp":
        _check_fsdp(cfg, ws, shape)
    if name == "localsgd":
        _int_at_least(cfg, "sync_every", 1, "1 averages every step (equals ddp); 4-16 saves bandwidth.")
        _int_at_least(cfg, "warmup_steps", 0, "0 starts local SGD at once; some DDP steps first often help.")
        if s.get("comm_hook") is not None:
            raise ConfigError(
                "strategy.comm_hook",
                s["comm_hook"],
                "null with strategy=localsgd",
                "local SGD registers its own DDP comm hook (post_localSGD_hook); DDP takes only one.",
            )


def _check_fsdp(cfg: dict[str, Any], ws: int, shape: str) -> None:
    s = cfg["strategy"]
    replicate = _int_at_least(cfg, "replicate", 1, "1 is plain FSDP; R > 1 is HSDP with mesh (R, world/R).")
    check_divides(
        "strategy.replicate",
        replicate,
        ws,
        shape,
        f"HSDP lays the ranks out as a (replicate, shard) mesh, so replicate x shard must be {ws}.",
    )
    _int_at_least(cfg, "min_num_params", 0, "0 turns size-based wrapping off.")
    for key in ("param_dtype", "reduce_dtype"):
        if s.get(key) not in DTYPES:
            raise ConfigError(
                f"strategy.{key}",
                s.get(key),
                one_of(DTYPES),
                "param_dtype follows amp.dtype by default; float32 everywhere means no casts.",
            )


def check_runtime(cfg: dict[str, Any], gpus: int, model: Any) -> None:
    """With the machine and the meta-device model: bf16 hook needs CUDA; wrap classes must exist."""
    name, s = cfg["strategy"]["name"], cfg["strategy"]
    if name in DDP_FAMILY and s.get("comm_hook") == "bf16" and gpus == 0:
        raise ConfigError(
            "strategy.comm_hook",
            "bf16",
            "null or fp16 on this machine (no CUDA GPUs, so the backend is gloo)",
            "PyTorch's bf16_compress_hook needs NCCL (CUDA); use strategy.comm_hook=fp16.",
        )
    wanted = s.get("wrap_classes") or []
    if name == "fsdp" and wanted:
        present = sorted({type(m).__name__ for m in model.modules()})
        missing = [c for c in wanted if c not in present]
        if missing:
            raise ConfigError(
                "strategy.wrap_classes",
                missing,
                f"class names of modules in this model: {', '.join(present)}",
                "write the class name only (Linear, not torch.nn.Linear), or use strategy.min_num_params.",
            )
