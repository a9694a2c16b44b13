"""data=mix: weighted mixtures, their shares, determinism for a seed and exact resume, in process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from unit_support import checked, disttrain_in_process

from disttrain.config.errors import ConfigError
from disttrain.data import build_datasets
from disttrain.data.mix import Mixture, mixture_table
from disttrain.data.samplers import ResumableSampler


def source(tag: int, n: int) -> TensorDataset:
    """n samples whose target is the source's tag and whose input is the sample's index."""
    return TensorDataset(torch.arange(n, dtype=torch.float32)[:, None], torch.full((n,), tag))


def read(mix: Mixture, rank: int, world: int, epoch: int, start: int = 0, batch: int = 50) -> list[Any]:
    """(tag, index) of every sample rank `rank` reads in `epoch`, from per-rank sample `start` on."""
    sampler = ResumableSampler(mix, num_replicas=world, rank=rank, shuffle=True, seed=7, drop_last=True)
    sampler.set_epoch(epoch)
    sampler.set_start(start)
    return [
        (int(t), int(x)) for x_b, t_b in DataLoader(mix, batch_size=batch, sampler=sampler)
        for x, t in zip(x_b[:, 0], t_b, strict=True)
    ]  # fmt: skip


def test_shares_follow_the_weights_on_every_rank() -> None:
    """0.75/0.25 over 4,000 samples: each source's share within 2 %, on each of 2 ranks' reads."""
    mix = Mixture({"a": source(0, 1000), "b": source(1, 5000)}, {"a": 0.75, "b": 0.25}, size=4000, seed=1)
    for rank in range(2):
        tags = [t for t, _ in read(mix, rank, 2, epoch=0)]
        assert len(tags) == 2000
        assert abs(tags.count(0) / len(tags) - 0.75) < 0.02
    assert mix.counts(range(4000)) == {"a": 3000, "b": 1000}  # exact over the whole table
    # a is smaller than its share: each of its samples comes 3 times; b's 1000 are distinct
    sources, indices = mix.table.locate(np.arange(len(mix)))
    a = [i for s, i in zip(sources, indices, strict=True) if s == 0]
    b = [i for s, i in zip(sources, indices, strict=True) if s == 1]
    assert np.bincount(a).tolist() == [3] * 1000 and len(set(b)) == 1000


def test_the_table_is_a_function_of_seed_and_weights() -> None:
    one = mixture_table([100, 300], [1.0, 3.0], 400, seed=5)
    again = mixture_table([100, 300], [1.0, 3.0], 400, seed=5)
    assert np.array_equal(one[0], again[0]) and np.array_equal(one[1], again[1])
    other = mixture_table([100, 300], [1.0, 3.0], 400, seed=6)
    assert not np.array_equal(one[0], other[0])
    assert np.bincount(one[0]).tolist() == [100, 300]
    assert np.bincount(mixture_table([10, 10, 10], [1, 1, 1], 10, seed=0)[0]).tolist() == [4, 3, 3]


def test_a_resumed_epoch_reads_exactly_the_rest_and_the_counts_match_what_was_read() -> None:
    """Cut mid-epoch at 600 samples per rank: the rest is what the uninterrupted run read next,
    and `data/mix/<name>` (computed from the state alone) equals the samples actually read."""
    mix = Mixture({"a": source(0, 1000), "b": source(1, 5000)}, {"a": 0.75, "b": 0.25}, size=4000, seed=1)
    whole = [read(mix, r, 2, epoch=1) for r in range(2)]
    rest = [read(mix, r, 2, epoch=1, start=600) for r in range(2)]
    assert [w[600:] for w in whole] == rest
    sampler = ResumableSampler(mix, num_replicas=2, rank=0, shuffle=True, seed=7, drop_last=True)
    counts = mix.consumed_counts(sampler, epoch=1, epoch_samples=1200, per_epoch=4000)
    first_epoch = [read(mix, r, 2, epoch=0) for r in range(2)]
    read_so_far = [t for r in range(2) for t, _ in first_epoch[r] + whole[r][:600]]
    assert counts == {"data/mix/a": read_so_far.count(0), "data/mix/b": read_so_far.count(1)}


def test_global_order_is_what_the_ranks_read_together() -> None:
    data = source(0, 103)
    samplers = [
        ResumableSampler(data, num_replicas=3, rank=r, shuffle=True, seed=2, drop_last=True) for r in range(3)
    ]
    for s in samplers:
        s.set_epoch(4)
    per_rank = [list(s) for s in samplers]
    dealt = [per_rank[p % 3][p // 3] for p in range(102)]
    assert samplers[0].global_order(4) == dealt


MIX = (
    "data=mix",
    "data.num_features=1",
    "data.num_classes=2",
    "data.mix.a={weight: 3, _target_: test_data_mix.source, tag: 0, n: 300}",
    "data.mix.b={weight: 1, builtin: synthetic, num_samples: 50, num_features: 1, num_classes: 2}",
)


def test_sources_by_target_and_builtin_from_the_config() -> None:
    train, val = build_datasets(checked(MIX)["data"])
    assert val is None and len(train) == 200  # b's 50 samples at a quarter: no sample repeats
    assert train.counts(range(len(train))) == {"a": 150, "b": 50}


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("data.mix.b.weight=0", "data.mix.b.weight"),
        ("data.mix.b.builtin=imagenet", "data.mix.b.builtin"),
        ("data.mix.b.num_features=3", "data.mix.b"),  # samples shaped unlike a's
        ("data.mix.b.nope=1", "data.mix.b.nope"),  # a key the built-in does not take
    ],
)
def test_mistakes_name_the_source(extra: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_datasets(checked([*MIX, extra])["data"])
    assert err.value.key == key, err.value


def _synthetic(seed: int, n: int) -> str:
    weight = 3 if seed == 1 else 1
    return f"{{weight: {weight}, builtin: synthetic, num_samples: {n}, num_features: 8, seed: {seed}}}"


RUN = (
    "train", "nproc_per_node=1", "trainer.progress=false", "threads_per_rank=1", "data=mix",
    "data.num_features=8", "data.num_classes=4", "data.size=200", f"data.mix.a={_synthetic(1, 300)}",
    f"data.mix.b={_synthetic(2, 100)}", "trainer.batch_size=16", "trainer.max_steps=20",
    "trainer.log_every=2", "trainer.ckpt_every=10", "trainer.val_every=0",
)  # fmt: skip


def test_a_run_logs_source_counts_and_resumes_them_exactly(scratch: Path) -> None:
    """Through the CLI (one rank, in process): data/mix/<name> counts the samples trained on, across
    the epoch boundary (12 steps of 16 in an epoch of 200); resumed from step 10, the run's losses
    and counts are the uninterrupted run's, bitwise."""
    full = disttrain_in_process(*RUN, "hydra.run.dir=full", cwd=scratch)
    assert full.returncode == 0, full.stderr[-2000:]
    resumed = disttrain_in_process(
        *RUN, "hydra.run.dir=resumed", "resume=full/checkpoints/step_00000010", cwd=scratch
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    def train(run: str) -> dict[int, tuple[float, float, float]]:
        lines = (scratch / run / "metrics.jsonl").read_text().splitlines()
        records = [r for r in map(json.loads, lines) if "train/loss" in r]
        return {r["step"]: (r["train/loss"], r["data/mix/a"], r["data/mix/b"]) for r in records}

    steps = train("full")
    assert list(steps) == list(range(2, 21, 2))
    assert all(a + b == 16 * step for step, (_, a, b) in steps.items())
    assert 0.65 < steps[20][1] / 320 < 0.85  # a's share of a 3:1 mixture
    after = train("resumed")
    assert after and {s: steps[s] for s in after} == after and min(after) == 12


def test_d17_a_huge_mixture_is_computed_place_by_place_not_tabled() -> None:
    """Reliability review 2026-11-28 D17: data.size=2e9 built a table of 2e9 places in every
    process (bad_alloc at 7.5 GB). The table is now a keyed bijection: nothing grows with size,
    any place is read directly, and the places of a small mixture are still exactly shared out."""
    mix = Mixture(
        {"a": source(0, 1000), "b": source(1, 5000)}, {"a": 0.75, "b": 0.25}, size=2_000_000_000, seed=1
    )
    held = [v.nbytes for v in vars(mix.table).values() if isinstance(v, np.ndarray)]
    assert max(held) <= 16, held  # the two sources' cumulative counts, nothing per place
    x, t = mix[1_999_999_999]
    assert int(t) in (0, 1) and 0 <= int(x[0]) < (1000 if int(t) == 0 else 5000)
    places = np.arange(1_000_000)  # a prefix of the shuffled places: the shares hold there too
    assert abs(mix.table.source_counts(places)[0] / 1_000_000 - 0.75) < 0.01


def test_permute_is_a_bijection_for_any_size() -> None:
    from disttrain.data.mix import permute

    for n in (1, 2, 3, 7, 64, 1000, 4097):
        out = permute(np.arange(n), n, key=11)
        assert sorted(out.tolist()) == list(range(n)), n
    assert not np.array_equal(permute(np.arange(1000), 1000, 1), permute(np.arange(1000), 1000, 2))


@pytest.mark.parametrize("weight", ["inf", "nan", "1e308"])
def test_d17_infinite_or_extreme_weights_are_a_paragraph_or_work(weight: str) -> None:
    """inf (or a weight sum that overflows) is refused naming the key; 1e308 beside 1 is legal."""
    mix = [
        *MIX[:3],
        f"data.mix.a={{weight: {weight}, _target_: test_data_mix.source, tag: 0, n: 300}}",
        MIX[4],
    ]
    if weight == "1e308":
        train, _ = build_datasets(checked(mix)["data"])
        assert train.counts(range(len(train)))["a"] == len(train)  # b's share rounds to nothing
        return
    with pytest.raises(ConfigError) as err:
        build_datasets(checked(mix)["data"])
    assert err.value.key == "data.mix.a.weight", err.value
