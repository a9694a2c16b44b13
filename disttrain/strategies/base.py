"""The small interface every strategy implements; the engine talks only to this.

Modelled on Lightning Fabric's Strategy: the engine never asks `isinstance(model, DDP)`.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disttrain.config.schema import AmpConfig
from disttrain.dist import DistEnv
from disttrain.strategies import specs
from disttrain.strategies.precision import Precision
from disttrain.strategies.specs import StrategyConfig
from disttrain.tasks import Task


class Strategy:
    """Data-parallel defaults: the whole model on every rank, gradients averaged by the wrapper.

    `cfg` is the typed config of the strategy's spec (a subclass narrows its type); the spec is the
    one home of its name and defaults.
    """

    cfg: StrategyConfig
    sharded_scaler = False  # sharded gradients need the sharded grad scaler (it all-reduces "found inf")
    # The first step may run under FlopCounterMode (MFU for any model): its module tracker puts
    # multi-grad hooks on tensors, which autograd.grad on inputs refuses (pipelining's stage backward).
    flops_countable = True
    # peft=lora: state dicts (checkpoints, final.pt) hold the trainable parameters and the buffers,
    # never the frozen base (DCP's ignore_frozen_params); a load then leaves only frozen ones unset.
    trainable_only = False

    def __init__(self, cfg: StrategyConfig, env: DistEnv, amp: AmpConfig | None = None) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.env = env
        self.layout = specs.get(cfg.name).layout(cfg, env.world_size)  # its degrees and meshes
        self.precision = Precision(amp, env.device, sharded=self.sharded_scaler)  # None: amp off

    # ---------------------------------------------------------------- setup
    def setup_module(self, model: nn.Module) -> nn.Module:
        return model.to(self.env.device)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    def model_key(self, key: str) -> str:
        """The single-process model's name for `key` of `unwrap(model).state_dict()` (a pipeline
        stage renames its layers): what checkpoints and init.path sources call it."""
        return key

    def data_parallel_rank_size(self) -> tuple[int, int]:
        """(rank, size) among the data-parallel replicas: who reads which shard of each batch.

        Ranks that split one model (pipeline stages, tensor-parallel or context-parallel shards)
        read the same data: the layout's meshes are row-major with dp outermost.
        """
        return self.env.rank // (self.layout.world // self.layout.dp), self.layout.dp

    def rng_rank(self) -> int:
        """Which random stream this rank draws from (dropout masks, ...): the worker seeds it with
        `seed + rng_rank()` once the model is built. Ranks that apply random ops to the same
        replicated activations must draw the same numbers, or their replicated parameters drift
        apart; here every rank holds its own replica and draws its own."""
        return self.env.rank

    def reshard(self, model: nn.Module) -> None:
        """Drop any full parameters gathered from shards (fsdp), so that the next forward reads the
        shards as they are now (after their values were swapped, e.g. the EMA's in and out)."""

    def end_of_training(self, model: nn.Module) -> None:
        """After the last optimizer step, before the final validation and checkpoint (not on a stop)."""

    # ---------------------------------------------------------------- step
    def no_backward_sync(self, model: nn.Module, enabled: bool) -> Any:
        """Skip the gradient all-reduce inside this context (non-final accumulation micro-steps)."""
        return nullcontext()

    def forward_backward(
        self, model: nn.Module, inputs: Any, target: Any, task: Task, scale: float
    ) -> torch.Tensor:
        """Forward, loss x `scale` (1/grad_accum), backward; returns the detached scaled loss.

        Strategies that split the model across ranks (pipeline) override this as a whole.
        """
        with self.precision.autocast():
            loss = task.loss(task.forward(model, inputs, target), target)
            if scale != 1.0:  # no multiply (and its backward) without accumulation
                loss = loss * scale
        self.backward(self.precision.scale(loss))
        return loss.detach().float()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def eval_step(self, model: nn.Module, inputs: Any, target: Any, task: Task) -> torch.Tensor:
        """[loss x n, metric numerator, n] for one validation batch (float64, on the device)."""
        with self.precision.autocast():
            out = task.forward(model, inputs, target)
        return task.eval_sums(out, inputs, target)

    def clip_grad_norm(self, model: nn.Module, max_norm: float | None) -> torch.Tensor:
        """Clip to `max_norm` (None: only measure) and return the total norm before clipping."""
        params = [p for p in model.parameters() if p.grad is not None]
        if max_norm is None:
            return torch.nn.utils.get_total_norm([p.grad for p in params])  # type: ignore[misc]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def flops_copies(self) -> int:
        """Ranks whose FlopCounterMode counts the same FLOPs (the counts are summed over ranks, then
        divided by this): 1 here, as each rank computes its own batch on full (or gathered) weights."""
        return 1

    def gpus_per_rank(self) -> int:
        """Devices one rank computes on (MFU divides by the GPUs a run drives, not its ranks)."""
        return 1

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if not dist.is_initialized() or self.env.world_size == 1:
            return tensor
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor / self.env.world_size if op == "mean" else tensor

    def barrier(self) -> None:
        if dist.is_initialized() and self.env.world_size > 1:
            dist.barrier()

    def data_parallel_group(self) -> Any:
        """The process group of this rank's data-parallel replicas (None: the default group)."""
        return None

    def sync_buffers(self, model: nn.Module, also: Iterable[torch.Tensor] = ()) -> None:
        """Make the buffers of every data-parallel replica one model's: floating-point ones (BatchNorm's
        running statistics, which each replica updates from its own batches, DDP's broadcast
        included: it comes before the forward that updates them) become their mean across the
        replicas, integer ones (BatchNorm's batch counter: equal anyway) their maximum. The engine
        calls it on every rank before each validation and each save, so that a run validates, and
        its checkpoint holds, the same model that `disttrain eval` later rebuilds. `also`: more
        such tensors (the EMA's averages of the buffers)."""
        size = self.data_parallel_rank_size()[1]
        if size > 1 and dist.is_initialized():
            average_buffers([*self.unwrap(model).buffers(), *also], size, self.data_parallel_group())

    # ---------------------------------------------------------------- state
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full, unwrapped state dict as plain PyTorch would save it: CPU tensors on rank 0 (the
        writing rank), {} on the others. Every rank calls it: a DTensor (fsdp, tp) is gathered one
        tensor at a time, a collective, and the other ranks drop each full tensor at once; nothing
        reaches their host memory (torch's full_state_dict + cpu_offload: ranks_only=(0,)). A tied
        weight (an embedding and its head) is one tensor under both names, as in the model."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.trainable_only
        )
        module = self.unwrap(model)
        state: dict[str, torch.Tensor] = self._trainable(model, get_model_state_dict(module, options=full))
        first: dict[int, str] = {}
        for key, source in module.state_dict(keep_vars=True).items():
            if key in state and first.setdefault(id(source), key) != key:
                state[key] = state[first[id(source)]]  # gathered twice: the second copy goes
        return state

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Model and optimizer state for a sharded checkpoint (torch.distributed.checkpoint).

        Every rank calls it. The default (DCP's get_state_dict) gives unwrapped parameter names and
        each rank's own shards (DTensors under FSDP2/TP, full tensors under DDP), so a checkpoint
        reshards on load to another world size or strategy. Pipeline stages may override both.
        `optimizer` None (eval, predict): the model's entries only. get_state_dict would build the
        optimizer's state first (a zero gradient and a step: 2x the parameters' bytes for AdamW).
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if optimizer is None:
            return {
                "model": self._trainable(
                    model, get_model_state_dict(model, options=self.state_dict_options())
                )
            }
        model_state, optim_state = get_state_dict(model, optimizer, options=self.state_dict_options())
        return {"model": self._trainable(model, model_state), "optim": optim_state}

    def _frozen_names(self, model: nn.Module) -> set[str]:
        """The names of the frozen parameters, a tied alias of one included (`ignore_frozen_params`
        leaves a head tied to a frozen embedding in: named_parameters() lists a tied one once)."""
        module = self.unwrap(model)
        return {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def _trainable(self, model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        if not self.trainable_only:
            return state
        frozen = self._frozen_names(model)
        return {k: v for k, v in state.items() if k not in frozen}

    def state_dict_options(self) -> Any:
        """DCP's StateDictOptions for this run's sharded state dicts (`trainable_only`: without the
        frozen parameters, and a load that does not ask for them)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.trainable_only, strict=not self.trainable_only)

    def check_loaded(self, model: nn.Module, keys: Any) -> None:
        """After a non-strict load (`trainable_only`): every key left out must be a frozen parameter."""
        if not self.trainable_only:
            return
        frozen = self._frozen_names(model)
        missing = [
            k
            for k in getattr(keys, "missing_keys", [])
            if k not in frozen and k.removeprefix("module.") not in frozen
        ]
        unexpected = list(getattr(keys, "unexpected_keys", []))
        if missing or unexpected:
            raise RuntimeError(
                f"the checkpoint does not fit the model's trainable part: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )

    def load_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]
    ) -> None:
        """Apply `state` (shaped like `state_dict()`, filled from a checkpoint) to model and optimizer."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        options = self.state_dict_options()
        if optimizer is None:
            self.check_loaded(model, set_model_state_dict(model, state["model"], options=options))
            return
        keys = set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
        self.check_loaded(model, keys)

    def optimizer_states(self, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """The per-parameter state this rank holds (a wrapper such as ZeRO keeps it in an inner optimizer)."""
        return list(optimizer.state.values())

    def state_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer state (local shards only).

        Gradients are counted at their size during a step (one per trainable parameter, as its local
        shard), since the engine frees them (`set_to_none`) between steps.
        """
        params = list(model.parameters())
        return {
            "params": sum(_local_bytes(p) for p in params),
            "grads": sum(_local_bytes(p) for p in params if p.requires_grad),
            "optimizer": sum(
                _local_bytes(v)
                for state in self.optimizer_states(optimizer)
                for v in state.values()
                if torch.is_tensor(v)
            ),
        }

    def summary_stats(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Strategy numbers for summary.json; a collective (every rank calls it, rank 0 writes)."""
        mine = self.state_bytes(model, optimizer)
        per_rank: list[Any] = [mine]
        if dist.is_initialized() and self.env.world_size > 1:
            per_rank = [None] * self.env.world_size
            dist.all_gather_object(per_rank, mine)
        return {
            "state_bytes_per_rank": sum(mine.values()),
            "state_bytes_by_rank": [sum(d.values()) for d in per_rank],
            "state_bytes_detail_by_rank": per_rank,
            **self.precision.summary(),  # amp=fp8: the Float8Linear layers
        }


def place_unsharded(model: nn.Module, device: torch.device) -> nn.Module:
    """Move, tensor by tensor, what sharding left off `device`: plain (not DTensor) parameters and
    buffers, such as the norms and embeddings tensor parallelism keeps replicated.

    Never `model.to(device)` before sharding: that puts the whole fp32 model on every GPU, the one
    thing FSDP exists to avoid (`fully_shard` and `distribute_tensor` move each unit or weight
    themselves). Meta tensors stay on meta, so a model built there can be materialised later with
    `to_empty`. `.data` is swapped in place, so tied parameters stay one tensor.
    """
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for module in model.modules():
            for p in module.parameters(recurse=False):
                if not isinstance(p, DTensor) and not p.is_meta and p.device != device:
                    p.data = p.data.to(device)
            for name, b in module.named_buffers(recurse=False):
                if not isinstance(b, DTensor) and not b.is_meta and b.device != device:
                    module._buffers[name] = b.to(device)
    return model


def average_buffers(buffers: Iterable[torch.Tensor], size: int, group: Any = None) -> None:
    """Floating-point `buffers` become their mean over the `size` ranks of `group`, integer ones
    their maximum (booleans are left alone). One all-reduce per dtype; the sum runs in float64,
    so buffers that already agree (a rotary table) stay bit for bit what they were. A DTensor
    buffer's local part is reduced: the same shard on each replica."""
    from torch.distributed.tensor import DTensor

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in buffers:
        local = b.to_local() if isinstance(b, DTensor) else b
        if local.is_meta or local.dtype == torch.bool or local.is_complex():
            continue
        by_dtype.setdefault(local.dtype, []).append(local)
    with torch.no_grad():
        for dtype, tensors in by_dtype.items():
            floating = dtype.is_floating_point
            flat = torch.cat([t.reshape(-1).to(torch.float64 if floating else dtype) for t in tensors])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM if floating else dist.ReduceOp.MAX, group=group)
            if floating:
                flat /= size
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                t.copy_(part.view_as(t))


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes of the part of `t` stored on this rank (a DTensor's local shard, not its global shape)."""
    from torch.distributed.tensor import DTensor  # not at module top: single/ddp never need it

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()
