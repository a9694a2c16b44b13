"""Packed rows against padding to the longest: real tokens trained per second on skewed lengths.

A data set of documents with skewed lengths (log-normal: most are short, a few fill a row) trains
the built-in gpt (task=lm, AdamW) on the CPU, in this process, two ways with the same rows per batch:

- **padded**: one document per row (`PackedRows(pack=False)`), each batch cut to its longest
  document (a per-batch "pad to the longest" collate, the usual baseline);
- **packed**: `data.packing=true`'s rows (`PackedRows`): documents next-fit into rows of
  `--block` tokens, positions restarting and attention kept within each document.

Both read their rows in the same seeded random order. Rounds alternate (padded, packed, ...) so a
change in the host's load hits both; the median of each is reported. Real tokens are the trained
targets (labels other than -100); tokens/s is real tokens over wall time. Goal: ratio >= 2.

    python scripts/bench_packing.py                 # ~1-2 min on 2 busy cores
    python scripts/bench_packing.py --docs 6000 --block 256 --steps 20 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from disttrain.data.packing import IGNORE, PackedRows
from disttrain.models.gpt import GPT
from disttrain.tasks.builtin import LanguageModel


def documents(n: int, block: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    """`n` documents of log-normal lengths in [8, block] (median ~block/10), each ending with EOS 0."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(block / 10), 0.9, n).astype(int), 8, block)
    return [{"input_ids": [*rng.integers(1, vocab, k - 1).tolist(), 0]} for k in lengths]


def batches(rows: PackedRows, batch: int, steps: int, seed: int, trim: bool) -> list[dict[str, torch.Tensor]]:
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    out = []
    for s in range(steps):
        picked = [rows[i] for i in order[s * batch : (s + 1) * batch]]
        stacked = {k: torch.stack([r[k] for r in picked]) for k in picked[0]}
        if trim:  # pad to the longest document of the batch, not to the row
            longest = int((stacked["position_ids"][:, 1:] != 0).sum(1).max()) + 1
            stacked = {k: v[:, :longest] for k, v in stacked.items()}
        out.append(stacked)
    return out


def train(batches_: list[dict[str, torch.Tensor]], block: int, vocab: int) -> tuple[float, int]:
    """(seconds, real tokens) of a fresh model trained on `batches_` (after one warm-up step)."""
    torch.manual_seed(0)
    model = GPT(vocab_size=vocab, block_size=block, dim=64, n_layers=2, n_heads=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    task = LanguageModel()

    def step(b: dict[str, torch.Tensor]) -> int:
        inputs, target = task.unpack(b)
        loss = task.loss(task.forward(model, inputs, target), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return int((target != IGNORE).sum())

    step(batches_[0])
    began, real = time.perf_counter(), 0
    for b in batches_[1:]:
        real += step(b)
    return time.perf_counter() - began, real


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=3000)
    p.add_argument("--block", type=int, default=128, help="tokens per row (packed), the longest document")
    p.add_argument("--batch", type=int, default=8, help="rows per step, both ways")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--vocab", type=int, default=512)
    args = p.parse_args()
    docs = documents(args.docs, args.block, args.vocab, seed=0)
    padded_rows = PackedRows(docs, args.block, pack=False)
    packed_rows = PackedRows(docs, args.block, pack=True)
    lengths = [len(d["input_ids"]) for d in docs]
    print(
        f"{len(docs)} documents, lengths median {int(np.median(lengths))}, max {max(lengths)} tokens; "
        f"rows of {args.block}: padded {len(padded_rows)} (pad {padded_rows.pad_fraction():.0%}), packed "
        f"{len(packed_rows)} (pad {packed_rows.pad_fraction():.0%}); threads {torch.get_num_threads()}, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    need = (args.steps + 1) * args.batch
    if need > len(packed_rows):
        raise SystemExit(
            f"--steps {args.steps} x --batch {args.batch} needs {need} packed rows: raise --docs"
        )
    ways = {
        "padded": batches(padded_rows, args.batch, args.steps + 1, seed=1, trim=True),
        "packed": batches(packed_rows, args.batch, args.steps + 1, seed=1, trim=False),
    }
    rates: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(args.rounds):
        for name, bs in ways.items():
            seconds, real = train(bs, args.block, args.vocab)
            rates[name].append(real / seconds)
            print(
                f"round {r + 1} {name}: {real} real tokens in {seconds:.2f} s = {real / seconds:,.0f} tokens/s"
            )
    padded, packed = (statistics.median(rates[k]) for k in ("padded", "packed"))
    print(
        f"\nreal tokens/s, median of {args.rounds}: padded to the longest {padded:,.0f}, packed {packed:,.0f}"
    )
    print(f"ratio packed / padded: {packed / padded:.2f}x (goal >= 2x)  load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
