"""Pipeline parallelism: the model cut into stages, one (or, interleaved, several) per rank.

Built on `torch.distributed.pipelining`. Every rank builds the full model with the same seed (the
worker does), then keeps only its stages' layers, so the weights are those `single` would train.
The stages are split by hand from the model's `pipeline_layers()` (see disttrain.models.parallel):
no tracing, any layer type.

Numbers the engine sees are arranged so its all-reduces need no pipeline knowledge:

- forward_backward / eval_step return the real value on the rank holding the last stage and zeros
  elsewhere; `all_reduce` sums over all ranks (the stages are not data-parallel replicas, so the
  sum *is* the last stage's value, on every rank) - one collective per log, none per step.
- the loss per micro-batch is `task loss x scale / n_microbatches` (scale = 1/grad_accum), and
  the schedule does not rescale gradients (`scale_grads=False`), so the reported loss is the batch
  mean and the gradients are `single`'s, with gradient accumulation across steps intact.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disttrain.config.schema import AmpConfig
from disttrain.dist import DistEnv
from disttrain.models.parallel import pipeline_layers, stage_bounds
from disttrain.strategies.base import Strategy, place_unsharded
from disttrain.strategies.specs.model_parallel import PipelineStrategyConfig
from disttrain.tasks import Task

log = logging.getLogger("disttrain")

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64)
_HEADER = 10  # dtype, ndim, up to 8 dims
_STAGE_KEY = re.compile(r"stages\.(\d+)\.(\d+)\.")


class PipelineModule(nn.Module):
    """This rank's stages. Its parameters are what the optimizer and clipping see."""

    def __init__(self, stages: dict[int, nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleDict({str(s): m for s, m in stages.items()})

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("a pipelined model runs through PipelineStrategy.forward_backward / eval_step")


class PipelineStrategy(Strategy):
    cfg: PipelineStrategyConfig
    flops_countable = False  # stage backward is autograd.grad: "A leaf node was passed to ..."

    def __init__(self, cfg: PipelineStrategyConfig, env: DistEnv, amp: AmpConfig | None = None) -> None:
        super().__init__(cfg, env, amp)
        self.schedule_name = cfg.schedule
        self.n_micro = cfg.n_microbatches
        self.per_rank = cfg.stages_per_rank
        self.num_stages = env.world_size * self.per_rank
        # stage s lives on rank s % world (the looped layout interleaved schedules expect)
        self.local_ids = [s for s in range(self.num_stages) if s % env.world_size == env.rank]
        self.modules: dict[int, nn.Module] = {}
        self.names: dict[int, list[str]] = {}  # stage -> original layer names, in order
        self._schedule: Any = None
        self._task: Task | None = None
        self._scale = 1.0
        self.busy = DeviceClock(env.device)  # this rank's stage compute (forward/backward chunks)
        self.wall = DeviceClock(env.device)  # schedule.step
        self.timed_steps = 0
        self._warm = False

    @property
    def has_first(self) -> bool:
        return 0 in self.local_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.local_ids

    # ---------------------------------------------------------------------------------- setup
    def setup_module(self, model: nn.Module) -> nn.Module:
        layers = pipeline_layers(model)
        if layers is None:
            raise ValueError(f"{type(model).__name__} has no pipeline_layers() and is not an nn.Sequential")
        names = [n for n, _ in layers]
        bounds = stage_bounds(names, self.num_stages, self.cfg.split_points)
        for s in self.local_ids:
            chunk = layers[bounds[s] : bounds[s + 1]]
            self.names[s] = [n for n, _ in chunk]
            # this rank's stages only, tensor by tensor; a meta model (plan --simulate) stays meta
            self.modules[s] = place_unsharded(nn.Sequential(*[m for _, m in chunk]), self.env.device)
        if self.env.is_zero:
            plan = " | ".join(
                f"{names[bounds[s]]}..{names[bounds[s + 1] - 1]}" for s in range(self.num_stages)
            )
            log.info(
                "pipeline: %d stages (%d per rank), schedule %s, %d micro-batches: %s",
                self.num_stages,
                self.per_rank,
                self.schedule_name,
                self.n_micro,
                plan,
            )
        return PipelineModule(self.modules)  # the rest of the full model is dropped here

    def _build_schedule(self) -> Any:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        stages: list[Any] = [
            PipelineStage(self.modules[s], s, self.num_stages, self.env.device) for s in self.local_ids
        ]
        for stage in stages:
            self._time_compute(stage)
        # the last stage's loss is compute too (the theory counts it in that stage's forward)
        kwargs: dict[str, Any] = {"loss_fn": self._timed(self._microbatch_loss), "scale_grads": False}
        if self.schedule_name == "interleaved_1f1b":
            return ScheduleInterleaved1F1B(stages, self.n_micro, **kwargs)
        cls = Schedule1F1B if self.schedule_name == "1f1b" else ScheduleGPipe
        return cls(stages[0], self.n_micro, **kwargs)

    def _time_compute(self, stage: Any) -> None:
        """Count the time this stage computes (not waits), for the measured bubble."""
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            fn = getattr(stage, name, None)
            if fn is not None:
                setattr(stage, name, self._timed(fn))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = self.busy.start()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy.stop(started)

        return wrapper

    def _microbatch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._task is not None
        return self._task.loss(output, target) * (self._scale / self.n_micro)

    # ---------------------------------------------------------------------------------- step
    def forward_backward(self, model: nn.Module, x: Any, y: Any, task: Task, scale: float) -> torch.Tensor:
        """The task's inputs go through the stages as one tensor, its loss runs on the last stage
        (the pre-launch check refuses tasks that call the model any other way)."""
        self._task, self._scale = task, scale
        if self._schedule is None:
            self._schedule = self._build_schedule()
        losses: list[torch.Tensor] = []
        started = self.wall.start()
        args = (x,) if self.has_first else ()
        self._schedule.step(*args, target=y, losses=losses, return_outputs=False)
        if self._warm:
            self.wall.stop(started)
            self.timed_steps += 1
        else:  # the first step infers shapes and builds buffers: not counted
            self.busy.reset()
            self._warm = True
        if self.has_last:
            return torch.stack([loss.detach() for loss in losses]).sum().float()  # as forward_backward
        return torch.zeros((), device=self.env.device)

    @torch.no_grad()
    def eval_step(self, model: nn.Module, x: Any, y: Any, task: Task) -> torch.Tensor:
        """Forward only, stage by stage with point-to-point sends: any batch size, no schedule."""
        world, rank = self.env.world_size, self.env.rank
        act: torch.Tensor | None = None
        for s in self.local_ids:
            prev = (s - 1) % world
            if s == 0:
                act = x
            elif prev != rank:
                act = _recv(prev, self.env.device)
            act = self.modules[s](act)
            if s < self.num_stages - 1 and (s + 1) % world != rank:
                _send(act, (s + 1) % world)
        if not self.has_last:
            return torch.zeros(3, dtype=torch.float64, device=self.env.device)
        assert act is not None
        return task.eval_sums(act, x, y)

    def clip_grad_norm(self, model: nn.Module, max_norm: float | None) -> torch.Tensor:
        """The global norm over all stages (sum of squares all-reduced); the same coefficient everywhere."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        local = torch.zeros((), dtype=torch.float32, device=self.env.device)
        if grads:
            local = (
                torch.stack([torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in grads])
                .square()
                .sum()
            )
        total = self.all_reduce(local, op="sum").sqrt()
        if max_norm is not None and grads:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return total

    # ---------------------------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Sum over stages: only the last stage holds a value, the others zeros (see module doc).

        With one data-parallel replica, 'mean' over replicas is that sum.
        """
        if not dist.is_initialized() or self.env.world_size == 1:
            return tensor
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    # ---------------------------------------------------------------------------------- state
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full model's state dict on rank 0 with the original names ({} on other ranks).

        Every rank calls it. The stages' names, shapes and dtypes travel as objects; the tensors
        reach rank 0 one at a time (send/recv on the device), and only rank 0 copies them to host
        memory. (`gather_object` of the stages would pickle every stage through rank 0's GPU.)
        """
        mine = [
            (s, i, self._original(f"stages.{s}.{k}"), v.detach())
            for s, module in self.modules.items()
            for i, (k, v) in enumerate(module.state_dict().items())
        ]
        if not dist.is_initialized() or self.env.world_size == 1:
            return {key: v.cpu() for _, _, key, v in mine}
        layout = [(s, i, key, tuple(v.shape), v.dtype) for s, i, key, v in mine]
        layouts: list[Any] = [None] * self.env.world_size if self.env.is_zero else []
        dist.gather_object(layout, layouts if self.env.is_zero else None, dst=0)
        if not self.env.is_zero:
            for *_, v in mine:
                dist.send(v.contiguous(), dst=0)
            return {}
        full = {(s, i): (key, v.cpu()) for s, i, key, v in mine}
        for src in range(1, self.env.world_size):
            for s, i, key, shape, dtype in layouts[src]:
                buffer = torch.empty(shape, dtype=dtype, device=self.env.device)
                dist.recv(buffer, src=src)
                full[(s, i)] = (key, buffer.cpu())
        return dict(full[at] for at in sorted(full))

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """This rank's stages for a sharded checkpoint, under the original names.

        The optimizer state is flattened per parameter (`state.<name>.exp_avg`,
        `param_groups.<name>.lr`): no list differs between ranks, so the stages' disjoint keys
        merge into one checkpoint that names parameters as `single` does. `optimizer` None: the
        model only (see Strategy.state_dict).
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_state_dict,
        )

        options = StateDictOptions(flatten_optimizer_state_dict=True)
        if optimizer is None:
            return {"model": {self._original(k): v for k, v in get_model_state_dict(model).items()}}
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        return {
            "model": {self._original(k): v for k, v in model_state.items()},
            "optim": {self._original(k): v for k, v in optim_state.items()},
        }

    def load_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]
    ) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_state_dict,
        )

        local = {orig: f"stages.{s}.{i}." for s, names in self.names.items() for i, orig in enumerate(names)}

        def back(key: str) -> str:
            head, sep, rest = (
                key.partition(".") if key.startswith(("state.", "param_groups.")) else ("", "", key)
            )
            for orig, mine in local.items():
                if rest.startswith(orig + "."):
                    return f"{head}{sep}{mine}{rest[len(orig) + 1 :]}"
            return key

        if optimizer is None:
            set_model_state_dict(model, {back(k): v for k, v in state["model"].items()})
            return
        set_state_dict(
            model,
            optimizer,
            model_state_dict={back(k): v for k, v in state["model"].items()},
            optim_state_dict={back(k): v for k, v in state["optim"].items()},
            options=StateDictOptions(flatten_optimizer_state_dict=True),
        )

    def model_key(self, key: str) -> str:
        return self._original(key)

    def _original(self, key: str) -> str:
        """`stages.<s>.<i>.<rest>` (anywhere in a key) -> `<name of layer i of stage s>.<rest>`."""
        return _STAGE_KEY.sub(lambda m: f"{self.names[int(m[1])][int(m[2])]}.", key, count=1)

    def summary_stats(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """State bytes, plus the measured idle (bubble) fraction per rank next to the theory."""
        stats = super().summary_stats(model, optimizer)
        mine = (self.busy.seconds(), self.wall.seconds())
        per_rank: list[Any] = [mine]
        if dist.is_initialized() and self.env.world_size > 1:
            per_rank = [None] * self.env.world_size
            dist.all_gather_object(per_rank, mine)
        idle = [1.0 - busy / wall if wall > 0 else None for busy, wall in per_rank]
        p, m, v = self.env.world_size, self.n_micro, self.per_rank
        steps = max(1, self.timed_steps)
        stats["pipeline"] = {
            "schedule": self.schedule_name,
            "stages": self.num_stages,
            "n_microbatches": m,
            "timed_steps": self.timed_steps,
            "idle_fraction_by_rank": idle,
            "idle_fraction": sum(i for i in idle if i is not None) / max(1, sum(i is not None for i in idle)),
            # (p-1)/(m+p-1) for one stage per rank; interleaving v stages shrinks the bubble v-fold
            "bubble_theory": (p - 1) / (v * m + p - 1),
            # a rank's compute for one micro-batch (forward + backward of all its stages): the theory
            # holds only where this dwarfs the per-action cost of the schedule and its p2p waits
            "compute_ms_per_microbatch": [1000 * busy / steps / m for busy, _ in per_rank],
        }
        return stats


# ------------------------------------------------------------------------------------------ timing
class DeviceClock:
    """Seconds the device spends inside timed regions (start() ... stop(token)), summed.

    On CPU ops run when called, so host time is compute time. On CUDA a call only queues kernels:
    host time would be launch time, not compute (review 2026-11-25-gpu-readiness #11). There a pair
    of CUDA events brackets each region on the current stream and the elapsed times are read once
    the events have completed: at `seconds()` (the end of training), or from the oldest pairs as
    they complete, without waiting, when many are pending. No synchronisation inside the step, so
    timing does not change the overlap it measures.
    """

    MAX_PENDING = 4096  # event pairs held before settling the completed ones

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._total = 0.0
        self._pending: list[tuple[Any, Any]] = []

    def start(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started: Any) -> None:
        if not self.cuda:
            self._total += time.perf_counter() - started
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((started, end))
        if len(self._pending) > self.MAX_PENDING:
            self._settle(wait=False)

    def _settle(self, wait: bool) -> None:
        if wait and self._pending:
            torch.cuda.synchronize(self.device)
        done = 0
        for begin, end in self._pending:
            if not (wait or end.query()):
                break
            self._total += begin.elapsed_time(end) / 1000.0  # ms
            done += 1
        del self._pending[:done]

    def seconds(self) -> float:
        """The total so far (on CUDA: waits for the timed kernels to finish)."""
        if self.cuda:
            self._settle(wait=True)
        return self._total

    def reset(self) -> None:
        self._total, self._pending = 0.0, []


# ------------------------------------------------------------------------------------------ p2p
def _send(t: torch.Tensor, dst: int) -> None:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
    header[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    dist.send(header.to(t.device), dst)
    dist.send(t.contiguous(), dst)


def _recv(src: int, device: torch.device) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    buf = torch.empty([int(d) for d in header[2 : 2 + ndim]], dtype=dtype, device=device)
    dist.recv(buf, src)
    return buf
