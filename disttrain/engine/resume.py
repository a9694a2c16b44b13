"""What exact resume needs beyond model and optimizer: RNG states, the position inside the epoch,
the config's fingerprint, and a stop flag that SIGTERM/SIGINT raise between steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import signal
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DistributedSampler

log = logging.getLogger("disttrain")


# ------------------------------------------------------------------------------------------ RNG
def rng_state() -> dict[str, Any]:
    """python, numpy, torch (and CUDA) RNG states as plain tensors/tuples (weights_only-loadable)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------ data
class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch at per-rank index `start`.

    The skipped part of the epoch's permutation is cut off by index (no batch is loaded), so a
    resumed run sees exactly the samples the interrupted one had not yet seen.
    """

    start: int = 0

    def set_start(self, start: int) -> None:
        self.start = max(0, start)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start :])

    def __len__(self) -> int:
        return max(0, super().__len__() - self.start)


# ------------------------------------------------------------------------------------------ config
# Keys that do not change what the run computes: logging, checkpointing, launching, naming.
NOT_SHAPING = (
    "name",
    "resume",
    "checkpoint",
    "launcher",
    "plan",
    "threads_per_rank",
    "master_addr",
    "master_port",
    "node_rank",
    "backend.timeout",
    "trainer.progress",
    "trainer.log_every",
    "trainer.val_every",
    "trainer.ckpt_every",
    "data.num_workers",
    "data.pin_memory",
)


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(cfg, dict):
        out: dict[str, Any] = {}
        for k, v in cfg.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: cfg}


def shaping_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The flattened config minus keys that do not shape training."""
    flat = flatten(cfg)
    return {k: v for k, v in flat.items() if not any(k == n or k.startswith(n + ".") for n in NOT_SHAPING)}


def config_hash(cfg: dict[str, Any]) -> str:
    text = json.dumps(shaping_config(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """'key: old -> new' for every shaping key that differs between two flattened configs."""
    keys = sorted(set(saved) | set(now))
    missing = "<absent>"
    return [
        f"{k}: {saved.get(k, missing)!r} -> {now.get(k, missing)!r}"
        for k in keys
        if saved.get(k, missing) != now.get(k, missing)
    ]


# ------------------------------------------------------------------------------------------ signals
class StopFlag:
    """SIGTERM/SIGINT set a flag; `agree()` after every step turns it into one stop step for all ranks.

    Agreement without taxing the step: after step N each rank waits for the MAX all-reduce of the
    flags it issued (asynchronously) after step N-1, then issues the next one. The reduce has a whole
    step to complete in the background, every rank reads the same value at the same step, and a
    signal that arrives during step N stops every rank right after step N+1, at any log_every.
    A second signal restores the default handler and re-raises it: the user can always force quit.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int = 0  # this rank's own signal
        self.agreed: int = 0  # the signal every rank stops on (0: none agreed)
        self._saved: dict[int, Any] = {}
        self._flag: torch.Tensor | None = None
        self._work: Any = None

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum:  # second signal: stop now
            self.__exit__()
            signal.raise_signal(signum)
            return
        self.signum = signum
        log.warning("%s received: stopping within the next two steps", signal.Signals(signum).name)

    def agree(self, device: torch.device) -> bool:
        """Every rank calls this after every step: True when all ranks stop now (the same step)."""
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            self.agreed = self.signum
            return bool(self.agreed)
        if self._work is not None:
            self._work.wait()
            self._work = None
            assert self._flag is not None
            self.agreed = int(self._flag.item())
            if self.agreed:
                return True
        if self._flag is None:
            self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._flag.fill_(self.signum)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)
        return False

    def drain(self) -> None:
        """At the end of training (or on an error): finish the reduce in flight. Its answer no longer
        matters: a run that reached its last step ends normally, with its final checkpoint."""
        work, self._work = self._work, None
        if work is not None:
            work.wait()

    @property
    def name(self) -> str:
        sig = self.agreed or self.signum
        return signal.Signals(sig).name if sig else ""
