"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across ranks.

Each wrapped submodule becomes one all-gather/reduce-scatter unit; the root is always wrapped last.
`replicate=R > 1` is HSDP: a 2D mesh (R, world/R), sharded within a row, replicated across rows.
Parameters are DTensors, so sizes, norms and state dicts go through the local shards or DCP.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from disttrain.models.blocks import repeated_blocks
from disttrain.models.parallel import has_forward
from disttrain.strategies.base import Strategy, place_unsharded
from disttrain.strategies.precision import DTYPES
from disttrain.strategies.specs.sharded import FSDPStrategyConfig

log = logging.getLogger("disttrain")


def modules_to_wrap(model: nn.Module, classes: set[str], min_num_params: int) -> list[nn.Module]:
    """Submodules (not the root) that get their own FSDP unit, children before parents.

    With `classes` (strategy.wrap_classes), a module is wrapped if its class name is in them. Without,
    the units are the model's repeated blocks (`repeated_blocks`), the outermost where blocks nest.
    Outside the units (never inside a block or a module of a chosen class: review G7), a module
    whose parameters not already claimed by a wrapped descendant number at least `min_num_params`
    (> 0) is wrapped too — the idea of FSDP1's `size_based_auto_wrap_policy`, the whole policy for a
    model without repeated blocks. Never a container without `forward`
    (ModuleList, ModuleDict): FSDP2 refuses them, so their parameters move up. A parameter tied to a
    module outside the subtree (the gpt's embedding and head) must sit in one unit with all its
    holders, so such a subtree is never a unit of its own: its parameters move up until a common
    ancestor (or the root) takes them.
    """
    holders = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    numel = {id(p): p.numel() for p in model.parameters()}
    blocks = set() if classes else {id(m) for m in repeated_blocks(model)}
    chosen: list[nn.Module] = []

    def visit(module: nn.Module, is_root: bool, in_unit: bool) -> Counter[int]:
        block = id(module) in blocks and not in_unit
        by_class = type(module).__name__ in classes or block
        unclaimed: Counter[int] = Counter(id(p) for p in module.parameters(recurse=False))
        for child in module.children():
            unclaimed += visit(child, False, in_unit or by_class)
        tied_outside = any(n < holders[pid] for pid, n in unclaimed.items())
        size = sum(numel[pid] for pid in unclaimed)
        by_size = min_num_params > 0 and size >= min_num_params and not in_unit
        wrappable = not is_root and has_forward(module) and unclaimed and not tied_outside
        if wrappable and (by_class or by_size):
            chosen.append(module)
            return Counter()
        return unclaimed

    visit(model, True, False)
    return chosen


def unit_names(units: list[nn.Module]) -> str:
    return ", ".join(sorted({type(m).__name__ for m in units})) or "none"


def mp_policy(param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    """param/reduce dtypes: `strategy.param_dtype` defaults to `${amp.dtype}`; fp32 means no casts."""
    param, reduce = DTYPES[param_dtype], DTYPES[reduce_dtype]
    if param == reduce == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def shard_units(
    model: nn.Module,
    units: list[nn.Module],
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    is_zero: bool,
    **kwargs: Any,
) -> None:
    """`fully_shard` each unit (children before parents), then the root, on `mesh` (its last
    dimension shards).

    The units reshard after forward as configured, except where a shard group has one rank: there
    resharding frees only the gathered (cast) copy and backward gathers it again, a cast and a copy
    per parameter plus the hooks' host time for nothing. The root is left to torch: not resharded
    after forward (its parameters, e.g. the tied embedding and head, are the first backward needs;
    resharded, they were gathered again, unoverlapped, at the start of backward: review G12).
    """
    if reshard_after_forward and mesh.shape[-1] == 1:
        reshard_after_forward = False
        if is_zero:
            log.info(
                "fsdp: a shard group of one rank: reshard_after_forward=false (resharding would only "
                "gather the same parameters again in backward)"
            )
    for module in units:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)  # reshard_after_forward=None: torch's choice for the root


@contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """FSDP2's reduce-scatter on (sync) or off inside the context; always back on after it."""
    assert isinstance(model, FSDPModule)
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class FSDPStrategy(Strategy):
    """fsdp, hsdp (replicate > 1) and zero2 (reshard_after_forward=False): one class, three specs."""

    cfg: FSDPStrategyConfig
    sharded_scaler = True

    def setup_module(self, model: nn.Module) -> nn.Module:
        """Shard unit by unit: each `fully_shard` moves only its own unit to the mesh's device, so
        the peak at setup is one unit, not the whole model (and a meta model stays on meta)."""
        mesh = self.device_mesh()
        kwargs: dict[str, Any] = {"mp_policy": mp_policy(self.cfg.param_dtype, self.cfg.reduce_dtype)}
        if self.cfg.cpu_offload:
            # pin_memory needs an accelerator; on a CPU-only machine the shards simply stay in RAM.
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.env.device.type == "cuda")
        units = modules_to_wrap(model, set(self.cfg.wrap_classes), self.cfg.min_num_params)
        names = unit_names(units)  # before fully_shard renames their classes (FSDP<Class>)
        shard_units(model, units, mesh, self.cfg.reshard_after_forward, self.env.is_zero, **kwargs)
        place_unsharded(model, self.env.device)  # what no unit manages (nothing today), one by one
        if self.env.is_zero:
            log.info("fsdp: mesh %s, root + %d wrapped units (%s)", tuple(mesh.shape), len(units), names)
        return model

    def device_mesh(self) -> DeviceMesh:
        """1D (world,) for FSDP; 2D (replicate, world/replicate) for HSDP."""
        names = ("replicate", "shard") if self.layout.dp_replicate > 1 else ("shard",)
        mesh: DeviceMesh = self.layout.mesh(self.env.device.type, names)
        return mesh

    def no_backward_sync(self, model: nn.Module, enabled: bool) -> Any:
        """Non-final micro-steps keep unsharded gradients locally; the last one reduce-scatters.

        A step without accumulation (`enabled=False`) touches nothing: the flag is already True, and
        setting it walks every FSDP unit twice per step for no effect.
        """
        return gradient_sync(model, sync=False) if enabled else nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float | None) -> torch.Tensor:
        # clip_grad_norm_/get_total_norm reduce DTensor shard norms across the mesh: the global norm.
        norm = super().clip_grad_norm(model, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def reshard(self, model: nn.Module) -> None:
        """With reshard_after_forward=False a forward leaves full parameters in place, and the next
        forward uses them as they are: free them, so that it gathers the shards again."""
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def state_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        self.reshard(model)  # count the shards, not full parameters a forward left in place
        return super().state_bytes(model, optimizer)
