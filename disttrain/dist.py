"""Where this rank stands: rank, local rank, world size, device, backend; joining the group; and
`gather_batch`, the one collective offered to a task's own code (uneven batches, with autograd)."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist

from disttrain.config.gpus import choose_backend


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str
    device: torch.device

    @property
    def is_zero(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, backend: str) -> DistEnv:
        """Read torchrun's variables (spawn sets the same ones)."""
        rank = int(os.environ.get("RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        backend = choose_backend(backend)
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise RuntimeError("backend nccl needs CUDA GPUs, but torch.cuda.is_available() is False")
            device = torch.device("cuda", cuda_index(local_rank, local_world))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        return cls(rank, local_rank, world, local_world, backend, device)


def cuda_index(local_rank: int, local_world: int) -> int:
    """This rank's CUDA device: its local rank, when the node shows every GPU to every rank. Where
    the scheduler binds GPUs per task (`srun --gpus-per-task=1`, `--gpu-bind`), each task sees only
    its own device(s), so fewer than the local ranks: `local_rank % count` picks among them."""
    count = torch.cuda.device_count()
    if local_rank < count:
        return local_rank
    if 0 < count < local_world and local_world % count == 0:
        return local_rank % count
    from disttrain.config.errors import ConfigError

    raise ConfigError(
        "LOCAL_RANK",
        local_rank,
        f"< {count} (the CUDA devices this process sees; CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}) for {local_world} local rank(s)",
        "give each rank its own GPU: at most one rank per visible GPU (nproc_per_node), or bind "
        "the same number of GPUs to every task (srun --gpus-per-task=1).",
    )


def group_backend(backend: str, cpu_collectives: bool = False) -> str:
    """The backend string of the default group: NCCL serves CUDA tensors only, so ranks that also
    run collectives on CPU tensors (`cpu_collectives`, the strategy spec decides) get gloo for those
    beside it, torch's `"cuda:nccl,cpu:gloo"`; gloo alone already serves both."""
    return "cuda:nccl,cpu:gloo" if backend == "nccl" and cpu_collectives else backend


def init_process_group(env: DistEnv, timeout_s: float, cpu_collectives: bool = False) -> None:
    """Join the group described by MASTER_ADDR/MASTER_PORT (env://), unless already joined.

    `cpu_collectives`: the strategy runs collectives on CPU tensors too (see `group_backend`)."""
    if dist.is_initialized():
        return
    kwargs: dict[str, object] = {"device_id": env.device} if env.backend == "nccl" else {}
    if env.world_size == 1 and "MASTER_PORT" not in os.environ:
        # one process and no port to meet at: no rendezvous (a one-rank Slurm job exports only
        # MASTER_ADDR, for torchrun's nodes)
        kwargs["store"] = dist.HashStore()
    elif (
        "TORCHELASTIC_RESTART_COUNT" in os.environ
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    ):
        kwargs["store"] = attempt_store(timeout_s)
    backend = group_backend(env.backend, cpu_collectives)
    if backend != env.backend and env.local_rank == 0:
        from disttrain.traps import warn_gloo_across_nodes

        warn_gloo_across_nodes(
            "the default group's gloo part (CPU tensors)", env.world_size, env.local_world_size
        )
    dist.init_process_group(
        backend=backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,  # type: ignore[arg-type]
    )


def attempt_store(timeout_s: float) -> dist.Store:
    """The torchrun agent's store, under a prefix unique to this restart attempt.

    torch's env:// rendezvous connects every attempt to the agent's one TCPStore *without* a
    per-attempt prefix (it assumes a fresh store per attempt, but the c10d rendezvous keeps one
    for the agent's lifetime). Keys of the dead attempt survive: gloo's connectFullMesh then reads
    the dead ranks' addresses ("Connection refused" to a stale port) and store-based barriers
    count the old arrivals (a rank waits in init for minutes). A prefix per attempt fixes both.
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return dist.PrefixStore(f"disttrain/{run_id}/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def default_store() -> dist.Store:
    """The store the default process group was built on (torchrun's agent store, under this
    attempt's prefix). Stop agreement, emergency agreement and hang reports use it: small keys,
    no collective. torch has no public accessor, hence the one private call, kept here."""
    return dist.distributed_c10d._get_default_store()


class Gathered(NamedTuple):
    """`gather_batch`'s result: every rank's rows, and where this rank's own rows start among them."""

    rows: torch.Tensor
    start: int


def gather_batch(t: torch.Tensor, group: Any = None) -> Gathered:
    """Every rank's `t` concatenated along dim 0 in rank order, and the row where this rank's part
    starts, for batches whose sizes differ across ranks (the last validation batch is smaller on
    some ranks: a plain `all_gather` of unequal tensors makes gloo abort the rank, NCCL hang or
    read garbage). Autograd flows through: each rank's rows get the gradient summed over every
    rank's loss, so with DDP's or FSDP's mean of the ranks' gradients the step follows the global
    mean loss, as one process holding the global batch would. For a loss with negatives from every
    rank (contrastive, CLIP). Every rank of `group` (None: the default group) calls it; without a
    process group, or in a group of one, it returns `(t, 0)` (the parent's dry step has none).

    How: an all-gather of the sizes, then each rank's rows padded to the largest and gathered by
    torch's functional all-gather (its backward reduce-scatters the gradients), the padding cut
    away. `torch.distributed.nn.functional.all_gather`, the older autograd gather, is deprecated in
    its favour; it lives in `torch.distributed._functional_collectives` (a private module name, so
    used here only)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return Gathered(t, 0)
    from torch.distributed import _functional_collectives as funcol

    group = group if group is not None else dist.group.WORLD
    size = torch.tensor([t.shape[0]], dtype=torch.long, device=t.device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    counts = [int(s) for s in sizes]
    most = max(counts)
    padded = t if t.shape[0] == most else torch.cat([t, t.new_zeros(most - t.shape[0], *t.shape[1:])])
    gathered = funcol.all_gather_single(padded.contiguous(), 0, group)
    rows = torch.cat([part[:n] for part, n in zip(gathered.split(most), counts, strict=True)])
    return Gathered(rows, sum(counts[: dist.get_rank(group)]))


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_main(run: Callable[[str], Any], module: str) -> int:
    """`python -m MODULE RUN_DIR` in a launched rank; torchelastic's @record writes its error file."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from disttrain.config.errors import ConfigError
    from disttrain.procs import ready_title

    ready_title()  # before the rank changes its environment (procs.ready_title)
    if len(sys.argv) != 2:
        sys.stderr.write(f"usage: python -m {module} RUN_DIR\n")
        return 2
    try:
        record(run)(sys.argv[1])
    except ConfigError:
        return 2  # @record wrote the paragraph for the launcher, the rank's log has it: no traceback
    except KeyboardInterrupt:  # Ctrl-C while the rank starts (the stop flag takes it in training)
        return 128 + signal.SIGINT
    except SystemExit as exc:  # a signal stop, state saved: exit as the signal would, like a success
        if isinstance(exc.code, int):
            return exc.code
        raise
    return 0


def exit_rank(code: int = 0) -> NoReturn:
    """End a finished rank process now, skipping interpreter finalization.

    gloo's worker threads outlive destroy_process_group and may still be releasing the tensors of
    the last collective; if that happens while the interpreter finalizes, the rank aborts with
    "terminate called without an active exception" (SIGABRT) after training succeeded
    (pytorch/pytorch#179291; ~1 run in 10 here under load). Logs and metrics are closed by now.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def hostname() -> str:
    return socket.gethostname()
