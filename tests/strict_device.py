"""A strict-device collective world in one process: a CPU tensor reaching a default-group
collective fails as it does under NCCL ("No backend type associated with device type cpu").

NCCL serves only CUDA tensors, gloo serves CPU tensors too, so on this CPU-only machine every
collective call site "works" whatever device its tensor is on, and a tensor built without
`device=env.device` is found only on the first GPU run (review 2026-11-25-gpu-readiness #3).

How: torch's fake process group (`torch/testing/_internal/distributed/fake_pg.py`: no processes, no
communication, every rank's result is its own input) is registered a second time under the name
`strict_fake`, for ONE device type, so the group has a backend for that type only; c10d then
raises for any other device exactly where it raises for NCCL (`ProcessGroup::getBackend`).

Why that device type is `meta`, not `cuda`: the call sites build their tensors on `env.device`,
and this machine cannot create a CUDA tensor. The harness's `DistEnv` therefore names `meta` as the
rank's device: it plays CUDA's part (the one device the group accepts) and CPU stays foreign, as
under NCCL. The price: meta tensors hold no data, so code that reads a collective's result back
(`.item()`, `float()`, `.tolist()`) stops there with a meta error. `past_collectives` runs such
code up to that read and reports how many collectives it got through; a CPU tensor reaching a
collective before the read still fails with NCCL's words. Object collectives (`all_gather_object`,
`broadcast_object_list`) move pickled bytes in a tensor on the group's device; under NCCL that is
the bound CUDA device and works, here it would be meta (no bytes), so `strict_world` replaces them
with the fake group's CPU behaviour (every rank receives its own object) for the duration.
The group is bound to `meta:0` as `init_process_group(device_id=...)` binds NCCL's device, so
`barrier()` allocates on the group's device as it does under NCCL.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore, _create_fake_pg

from disttrain.dist import DistEnv

STRICT = "strict_fake"
DEVICE = torch.device("meta")
NCCL_CPU_ERROR = "No backend type associated with device type cpu"  # NCCL's words, and this group's
META_READ = (
    "meta tensor",
    "cannot be called on meta tensors",
    "data-independent implementation",
)  # data reads

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
)


def register() -> None:
    """Register the strict backend once (torch's registry is process-wide and has no unregister).

    `register_backend` also makes it the default backend for `meta` in `default_device_backend_map`
    (read by `init_process_group()` without a backend); that entry is removed again so the rest of
    the suite never meets it: the group's device capability (`backend_capability`) is what counts.
    """
    if STRICT in dist.Backend.backend_list:
        return
    known = dict(dist.Backend.default_device_backend_map)
    dist.Backend.register_backend(STRICT, _create_fake_pg, extended_api=True, devices=[DEVICE.type])
    dist.Backend.default_device_backend_map.clear()
    dist.Backend.default_device_backend_map.update(known)


@contextlib.contextmanager
def strict_world(world_size: int = 2, rank: int = 0, *, monkeypatch: Any) -> Iterator[DistEnv]:
    """A default group of `world_size` ranks (this process is `rank`) that accepts `meta` tensors
    only; yields the rank's DistEnv (device meta, backend nccl: what the code under test reads)."""
    register()
    assert not dist.is_initialized(), "strict_world needs a process without a default group"
    dist.init_process_group(STRICT, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        group = dist.group.WORLD
        assert group is not None
        group.bound_device_id = torch.device(DEVICE.type, 0)  # as device_id= binds NCCL's device
        monkeypatch.setattr(dist, "all_gather_object", _mirror_gather)
        monkeypatch.setattr(dist, "broadcast_object_list", _keep_objects)
        yield DistEnv(rank, rank, world_size, world_size, "nccl", DEVICE)
    finally:
        dist.destroy_process_group()


def _mirror_gather(out: list[Any], obj: Any, group: Any = None) -> None:
    """The fake group's all_gather_object on CPU: every rank's slot holds this rank's object."""
    for i in range(len(out)):
        out[i] = obj


def _keep_objects(objects: list[Any], src: int = 0, group: Any = None, device: Any = None, **_: Any) -> None:
    """The fake group's broadcast_object_list: every rank keeps what it holds."""


def past_collectives(fn: Callable[[], Any], monkeypatch: Any) -> int:
    """Run `fn` until it returns or first reads a meta result back; the number of tensor collectives
    it ran meanwhile. A CPU tensor reaching a collective raises NCCL's error (not caught here)."""
    count = [0]
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def counted(*args: Any, _real: Callable[..., Any] = real, **kwargs: Any) -> Any:
            result = _real(*args, **kwargs)
            count[0] += 1
            return result

        monkeypatch.setattr(dist, name, counted)
    try:
        fn()
    except (RuntimeError, NotImplementedError) as exc:
        if not any(words in str(exc) for words in META_READ):
            raise
    return count[0]  # the wrappers stay until the test ends (monkeypatch restores them)
