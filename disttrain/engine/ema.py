"""trainer.ema: an exponential moving average of the weights, kept like the parameters themselves.

`torch.optim.swa_utils.AveragedModel` deep-copies the model, which FSDP2 refuses ("FSDP does not
support deepcopy") and which would hold a whole replica beside a sharded one. So the average is a
list of tensors shaped like the model's own state-dict entries (DTensor shards under fsdp/hsdp/zero2
and tp, whole tensors under ddp) and is updated over the local tensors with torch's own EMA step
(`get_ema_multi_avg_fn`: one `_foreach_lerp_` per dtype), with AveragedModel's rule: the first
update copies the weights, later ones move `1 - decay` of the way towards them. Floating-point
parameters and buffers are averaged (AveragedModel's `use_buffers=True`); integer buffers
(BatchNorm's batch counter) stay the model's own.

It is a `Stateful` of the checkpoint (`ema.weights.<name>`, `ema.updates`): DTensors reshard on load
like the model, and `disttrain export --ema` reads the same names.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from disttrain.config.schema import EmaConfig


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` (a DTensor's local shard, which in-place ops write through)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t.detach()


def _by_dtype(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[list[Any], list[Any]]]:
    """(ema, current) lists per (device, dtype): one foreach kernel each."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[Any], list[Any]]] = {}
    for ema, cur in pairs:
        e, c = groups.setdefault((ema.device, ema.dtype), ([], []))
        e.append(ema)
        c.append(cur)
    return list(groups.values())


class NullEMA:
    """trainer.ema off: the engine calls it without asking."""

    active = False

    def update(self, step: int) -> None:
        pass

    def swapped_in(self) -> Any:
        return nullcontext()

    def buffers(self) -> list[torch.Tensor]:
        """The averages of the model's floating-point buffers (none without an EMA)."""
        return []


class EMA(NullEMA):
    """The moving average of `model`'s floating-point state-dict entries (tied weights once), but
    frozen parameters."""

    staged_with_model = True  # an async save stages it with the model: no deep copy (see Checkpointer)

    def __init__(self, cfg: EmaConfig, model: nn.Module) -> None:
        from torch.optim.swa_utils import get_ema_multi_avg_fn

        assert cfg.decay, "build an EMA only when trainer.ema.decay is set"
        self.decay, self.every, self.start_step = float(cfg.decay), cfg.every, cfg.start_step
        self.step_fn = get_ema_multi_avg_fn(self.decay)
        self.sources: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        # keep_vars: the live parameters and buffers under the names a checkpoint gives them
        for name, t in model.state_dict(keep_vars=True).items():
            if isinstance(t, nn.Parameter) and not t.requires_grad:
                continue  # a frozen parameter (peft=lora's base) averages to itself: no copy of it
            if isinstance(t, torch.Tensor) and torch.is_floating_point(t) and id(t) not in seen:
                seen.add(id(t))
                self.sources[name] = t
        with torch.no_grad():
            self.weights = {k: t.detach().clone() for k, t in self.sources.items()}
        self.updates = 0

    @property
    def active(self) -> bool:  # type: ignore[override]
        """Whether the average holds anything yet (before start_step it is only the initial copy)."""
        return self.updates > 0

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step` (1-based): average when it is due."""
        if step < self.start_step or step % self.every:
            return
        ema = [_local(t) for t in self.weights.values()]
        current = [_local(t) for t in self.sources.values()]
        if self.updates == 0:
            torch._foreach_copy_(ema, current)
        else:
            for e, c in _by_dtype(list(zip(ema, current, strict=True))):
                self.step_fn(e, c, None)
        self.updates += 1

    def buffers(self) -> list[torch.Tensor]:
        """The averages of the model's floating-point buffers (BatchNorm's statistics): each replica
        averages its own, so the strategy averages them across replicas with the model's."""
        return [w for k, w in self.weights.items() if not isinstance(self.sources[k], nn.Parameter)]

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the averaged weights inside the context, its own again after it (a copy
        of the local tensors is kept meanwhile)."""
        live = [_local(t) for t in self.sources.values()]
        with torch.no_grad():
            kept = [t.clone() for t in live]
            torch._foreach_copy_(live, [_local(t) for t in self.weights.values()])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(live, kept)

    # ------------------------------------------------------------------------ Stateful
    def state_dict(self) -> dict[str, Any]:
        return {"weights": dict(self.weights), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, value in state["weights"].items():
                if value is not self.weights[name]:  # DCP loads in place; a plain dict is copied
                    self.weights[name].copy_(value)
        self.updates = int(state["updates"])


def build_ema(cfg: EmaConfig, model: nn.Module) -> NullEMA:
    """The EMA of the wrapped model's unwrapped module (`strategy.unwrap`), or a no-op."""
    return EMA(cfg, model) if cfg.decay else NullEMA()
