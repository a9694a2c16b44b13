"""The collectives `disttrain bench comm` runs: buffers with known values per rank, the call, its check.

Sizes and bandwidths follow nccl-tests (doc/PERFORMANCE.md, src/*.cu): `S` is the bytes of the whole
buffer (all_gather: the gathered output; reduce_scatter / all_to_all: each rank's input), algbw = S/t,
busbw = algbw x factor with factor 2(n-1)/n for all_reduce; (n-1)/n for reduce_scatter, all_gather,
all_to_all, gather and scatter; 1 for broadcast, reduce and send/recv. busbw is comparable to the
hardware's link bandwidth whatever the number of ranks.

Values: rank r holds f(r, i) = (i mod 251) + 256 (r mod 31) at element i, integers below 2^13, so every
sum over up to 2048 ranks is exact in float32 and a result is checked with exact equality: a chunk
from the wrong rank, at the wrong offset, or reduced twice is caught.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

OPS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "send_recv",
    "barrier",
)
ROOT = 0
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32}


def bus_factor(op: str, n: int) -> float | None:
    """nccl-tests' busbw / algbw for `op` on `n` ranks (None: no bandwidth, e.g. barrier)."""
    if op == "barrier":
        return None
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, send_recv


def values(ranks: torch.Tensor | int, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """f(r, i): the value rank r puts at element i (ranks may be a tensor, one per element)."""
    return ((index % 251) + 256 * (torch.as_tensor(ranks) % 31)).to(dtype)


def summed(n: int, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum over ranks r < n of f(r, i)."""
    return (n * (index % 251) + 256 * sum(r % 31 for r in range(n))).to(dtype)


@dataclass
class Case:
    """One op at one size on this rank: `fill` known inputs, `run` the op (timed), `check` it."""

    op: str
    nbytes: int
    run: Callable[[], object]
    fill: Callable[[], object]
    result: torch.Tensor | None  # what this rank checks (None: nothing, e.g. reduce off the root)
    expected: torch.Tensor | None
    source: torch.Tensor | None = None  # this rank's input after `fill` (for tests that simulate the op)

    def check(self) -> str | None:
        """None when the result is right, else where it first differs."""
        if self.result is None or self.expected is None:
            return None
        got = self.result.detach().reshape(-1).cpu()
        want = self.expected.reshape(-1)
        if torch.equal(got, want):
            return None
        bad = (got != want).nonzero()
        i = int(bad[0]) if len(bad) else 0
        return f"{len(bad)} of {want.numel()} elements wrong; first at {i}: got {got[i].item()}, expected {want[i].item()}"


def element_count(nbytes: int, n: int, itemsize: int) -> int:
    """Elements of the whole buffer: `nbytes` rounded up to a multiple of n elements (>= n)."""
    per_rank = max(1, -(-nbytes // (itemsize * n)))
    return per_rank * n


def make_case(op: str, nbytes: int, rank: int, n: int, dtype: torch.dtype, device: torch.device) -> Case:
    """Buffers, call and expected result of `op` with an S of about `nbytes` on this rank."""
    if op == "barrier":
        return Case(op, 0, lambda: dist.barrier(), lambda: None, None, None)
    itemsize = torch.empty((), dtype=dtype).element_size()
    c = element_count(nbytes, n, itemsize)
    chunk = c // n
    idx = torch.arange(c)
    mine = values(rank, idx, dtype).to(device)
    buf = torch.empty(c, dtype=dtype, device=device)
    part = torch.empty(chunk, dtype=dtype, device=device)
    nb = c * itemsize
    if op in ("all_reduce", "broadcast", "reduce"):
        want = {
            "all_reduce": summed(n, idx, dtype),
            "broadcast": values(ROOT, idx, dtype),
            "reduce": summed(n, idx, dtype) if rank == ROOT else None,
        }[op]
        call = {
            "all_reduce": lambda: dist.all_reduce(buf),
            "broadcast": lambda: dist.broadcast(buf, src=ROOT),
            "reduce": lambda: dist.reduce(buf, dst=ROOT),
        }[op]
        return Case(op, nb, call, lambda: buf.copy_(mine), buf if want is not None else None, want, buf)
    if op in ("all_gather", "gather"):
        own = values(rank, rank * chunk + torch.arange(chunk), dtype).to(device)
        want_all = values(idx // chunk, idx, dtype)
        if op == "all_gather":
            gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            return Case(
                op, nb, lambda: gather_single(buf, part), lambda: part.copy_(own), buf, want_all, part
            )
        slots = list(buf.chunk(n)) if rank == ROOT else None
        return Case(
            op,
            nb,
            lambda: dist.gather(part, slots, dst=ROOT),
            lambda: part.copy_(own),
            buf if rank == ROOT else None,
            want_all if rank == ROOT else None,
            part,
        )
    if op == "scatter":
        pieces = list(buf.chunk(n)) if rank == ROOT else None
        want = values(ROOT, rank * chunk + torch.arange(chunk), dtype)
        return Case(
            op, nb, lambda: dist.scatter(part, pieces, src=ROOT), lambda: buf.copy_(mine), part, want, buf
        )
    if op == "reduce_scatter":
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        want = summed(n, rank * chunk + torch.arange(chunk), dtype)
        return Case(op, nb, lambda: rs(part, buf), lambda: buf.copy_(mine), part, want, buf)
    if op == "all_to_all":
        src = torch.empty(c, dtype=dtype, device=device)
        want = values(idx // chunk, rank * chunk + idx % chunk, dtype)
        return Case(op, nb, lambda: dist.all_to_all_single(buf, src), lambda: src.copy_(mine), buf, want, src)
    if op == "send_recv":
        if n < 2:
            raise ValueError("send_recv needs at least 2 ranks")
        src = torch.empty(c, dtype=dtype, device=device)
        prev, nxt = (rank - 1) % n, (rank + 1) % n

        def exchange() -> None:  # nccl-tests' sendrecv: a ring, everyone sends and receives at once
            ops = [dist.P2POp(dist.isend, src, nxt), dist.P2POp(dist.irecv, buf, prev)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()

        return Case(op, nb, exchange, lambda: src.copy_(mine), buf, values(prev, idx, dtype), src)
    raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
