"""Streams (IterableDataset) and token files, in process: who reads which element (data.shard=auto),
the checks a stream without a length needs, and data=tokens' windows (tokens.py)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, IterableDataset
from unit_support import checked, write_module

from disttrain.config import ConfigError
from disttrain.data import streams
from disttrain.data.samplers import ResumableSampler
from disttrain.data.tokens import load_tokens

STREAM = '''
import torch
from torch.utils.data import IterableDataset

class Numbers(IterableDataset):
    """Samples (x, y) of 8 features and a class, as a stream with no length."""
    def __init__(self, n=64):
        self.n = n
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(self.n):
            yield torch.randn(8, generator=g), i % 4
'''


class Count(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n, self.at = n, 0

    def __iter__(self) -> Iterator[int]:
        while self.at < self.n:
            self.at += 1
            yield self.at - 1

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]


def _read(dataset: IterableDataset, worker: int, workers: int, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    info = SimpleNamespace(id=worker, num_workers=workers) if workers else None
    monkeypatch.setattr(streams, "get_worker_info", lambda: info)
    return list(dataset)


@pytest.mark.parametrize("dp_size,workers", [(1, 0), (2, 0), (2, 2), (3, 2)])
def test_shard_auto_gives_each_reader_its_slot_and_all_of_them_everything(
    dp_size: int, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[tuple[int, int], list[int]] = {}
    for rank in range(dp_size):
        for worker in range(max(1, workers)):
            wrapped = streams.shard(range_stream(50), "auto", rank, dp_size)
            seen[rank, worker] = _read(wrapped, worker, workers, monkeypatch)
    readers = dp_size * max(1, workers)
    for (rank, worker), items in seen.items():
        assert items == [i for i in range(50) if i % readers == rank * max(1, workers) + worker]
    assert sorted(i for items in seen.values() for i in items) == list(range(50))


def test_shard_none_and_map_style_data_are_left_as_they_are() -> None:
    stream = range_stream(5)
    assert streams.shard(stream, "none", 1, 2) is stream
    assert streams.shard([1, 2, 3], "auto", 1, 2) == [1, 2, 3]


def test_a_stateful_stream_sharded_resumes_at_its_position(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "get_worker_info", lambda: None)
    wrapped = streams.shard(Count(20), "auto", 1, 2)
    assert isinstance(wrapped, streams.StatefulShardedStream)
    it = iter(wrapped)
    assert [next(it) for _ in range(3)] == [1, 3, 5]
    state = pickle.loads(pickle.dumps(wrapped.state_dict()))
    again = streams.shard(Count(20), "auto", 1, 2)
    again.load_state_dict(state)
    assert list(again) == [7, 9, 11, 13, 15, 17, 19]


def range_stream(n: int) -> IterableDataset:
    class Stream(IterableDataset):
        def __iter__(self) -> Iterator[int]:
            return iter(range(n))

    return Stream()


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    write_module(tmp_path, "streamlab.data", STREAM)
    return tmp_path


STREAM_RUN = ["data=synthetic", "data.train._target_=streamlab.data.Numbers", "data.num_features=8"]


def test_a_stream_without_max_steps_is_one_paragraph_naming_it(user_dir: Path) -> None:
    with pytest.raises(ConfigError) as err:
        checked([*STREAM_RUN, "data.val=null"], runtime=True)
    assert err.value.key == "trainer.max_steps" and "Numbers has no length" in str(err.value)


def test_a_stream_validation_set_needs_val_batches(user_dir: Path) -> None:
    stream_val = ["data.val._target_=streamlab.data.Numbers", "trainer.max_steps=5"]
    with pytest.raises(ConfigError) as err:
        checked([*STREAM_RUN, *stream_val], runtime=True)
    assert err.value.key == "trainer.val_batches"
    cfg = checked([*STREAM_RUN, *stream_val, "trainer.val_batches=2"], runtime=True)  # the dry step runs
    assert cfg["trainer"]["val_batches"] == 2


def test_plan_simulate_samples_a_stream_batch(user_dir: Path) -> None:
    from unit_support import checked_run

    from disttrain.tools.simulate import sample_batch

    x, y = sample_batch(checked_run([*STREAM_RUN, "data.val=null", "trainer.max_steps=5"]), 3)
    assert x.shape == (3, 8) and y.tolist() == [0, 1, 2]  # the stream's first three samples


def test_val_batches_below_one_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        checked(["trainer.val_batches=0"])
    assert err.value.key == "trainer.val_batches"


# ------------------------------------------------------------------------------------ data=tokens
def _tokens(path: Path, n: int, dtype: type = np.uint16) -> np.ndarray:
    ids = (np.arange(n) * 7 % 1000).astype(dtype)
    ids.tofile(path)
    return ids


def test_sequential_windows_are_the_file_shifted_by_one(tmp_path: Path) -> None:
    ids = _tokens(tmp_path / "train.bin", 1000)
    data = load_tokens(str(tmp_path / "train.bin"), block_size=16, sampling="sequential")
    assert len(data) == (1000 - 1) // 16
    x, y = data[3]
    assert x.dtype == torch.int64 and x.tolist() == ids[48:64].tolist() and y.tolist() == ids[49:65].tolist()


def test_random_windows_are_fixed_by_seed_and_index_and_stay_inside(tmp_path: Path) -> None:
    ids = _tokens(tmp_path / "t.bin", 1000, np.uint32)
    a = load_tokens(str(tmp_path / "t.bin"), block_size=16, dtype="uint32", seed=1)
    b = load_tokens(str(tmp_path / "t.bin"), block_size=16, dtype="uint32", seed=1)
    starts = [a.offset(i)[1] for i in range(len(a))]
    assert starts == [b.offset(i)[1] for i in range(len(b))]  # the same for any process: resumable
    assert starts != [
        load_tokens(str(tmp_path / "t.bin"), block_size=16, dtype="uint32", seed=2).offset(i)[1]
        for i in range(len(a))
    ]
    assert min(starts) >= 0 and max(starts) <= 1000 - 17 and len(set(starts)) > len(starts) // 2
    x, y = a[5]
    assert (
        x.tolist() == ids[starts[5] : starts[5] + 16].tolist()
        and y.tolist() == ids[starts[5] + 1 : starts[5] + 17].tolist()
    )


def test_tail_validation_and_shards_never_mix(tmp_path: Path) -> None:
    for k in range(3):
        _tokens(tmp_path / f"shard_{k}.bin", 400)
    pattern = str(tmp_path / "shard_*.bin")
    train = load_tokens(pattern, block_size=10, sampling="sequential", val_fraction=0.25)
    val = load_tokens(pattern, block_size=10, split="val", val_fraction=0.25)
    assert [(Path(p.path).name, p.start, p.end) for p in train.parts] == [
        ("shard_0.bin", 0, 400),
        ("shard_1.bin", 0, 400),
        ("shard_2.bin", 0, 100),
    ]
    assert [(Path(p.path).name, p.start, p.end) for p in val.parts] == [("shard_2.bin", 100, 400)]
    assert len(train) == 39 + 39 + 9 and len(val) == 29
    assert train[39][0].tolist() == train[0][0].tolist()  # the second shard's first window (same ids)


def test_a_token_data_set_pickles_without_its_tokens(tmp_path: Path) -> None:
    _tokens(tmp_path / "big.bin", 200_000)
    data = load_tokens(str(tmp_path / "big.bin"), block_size=64)
    data[0]  # maps the file in this process
    assert data._maps
    blob = pickle.dumps(data)
    assert len(blob) < 2_000  # paths and counts, not 400 kB of tokens
    assert pickle.loads(blob)[7][0].tolist() == data[7][0].tolist()


@pytest.mark.parametrize("length,world,rank,start", [(103, 2, 1, 0), (103, 4, 3, 5), (8, 3, 0, 1)])
def test_the_unshuffled_sampler_is_a_range_equal_to_torchs_list(
    length: int, world: int, rank: int, start: int
) -> None:
    ours = ResumableSampler(range(length), num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    ours.set_start(start)
    torchs = list(
        DistributedSampler(range(length), num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    )
    assert list(ours) == torchs[start:] and len(ours) == len(torchs[start:])


def test_val_batches_caps_map_style_validation_and_sets_a_streams() -> None:
    from torch.utils.data import DataLoader

    from disttrain.data.samplers import ShardSampler
    from disttrain.engine.loop import val_batches

    shard = ShardSampler(101, rank=1, world=2)  # 50 samples here, 51 on rank 0
    loader = DataLoader(list(range(101)), batch_size=10, sampler=shard)
    assert val_batches(loader) == 6 and val_batches(loader, 4) == 4 and val_batches(loader, 9) == 6
    stream = DataLoader(range_stream(30), batch_size=10)
    assert val_batches(stream, 2) == 2
    with pytest.raises(ValueError, match="val_batches"):
        val_batches(stream)


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _rss_growth(path: Path, batches: int) -> float:
    """MB of RSS this process gains building rank 1 of 2's data=tokens loaders on `path` (random
    windows of 256 tokens, the held-out tail for validation) and reading up to `batches` of 16 from each."""
    from itertools import islice

    from disttrain.config.run import Run
    from disttrain.data import build_datasets
    from disttrain.data.loaders import make_loaders
    from disttrain.dist import DistEnv

    cfg = checked(["model=gpt", "data=tokens", f"data.path={path}", "data.block_size=256",
                   "data.val_fraction=0.001", "trainer.batch_size=16", "data.num_classes=1000"])  # fmt: skip
    before = _rss_mb()
    env = DistEnv(1, 1, 2, 2, "gloo", torch.device("cpu"))
    train, val = make_loaders(Run.of(cfg), env, *build_datasets(cfg["data"]))
    assert val is not None
    read = [sum(1 for _ in islice(loader, batches)) for loader in (train, val)]
    assert read[0] == batches and read[1] > 0, read
    return _rss_mb() - before


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads RSS from /proc")
def test_a_2_gb_token_file_costs_no_more_memory_than_a_2_mb_one(tmp_path: Path) -> None:
    """Issue 24's limit: with a 2 GB uint16 file a rank's RSS stays within 200 MB of the same run on a
    2 MB one. The big file is sparse (no 2 GB written; its holes read as token 0) and all of it is
    sampled from: 4.2 M windows, drawn from the seed (no 8.4 M-long permutation: data=tokens reads
    in order unless data.shuffle=true). Measured in this process: the loaders built, 40 batches read
    from training and the validation tail each, growth against the 2 MB file's; typically a few MB."""
    small, big = tmp_path / "small.bin", tmp_path / "big.bin"
    _tokens(small, 1024**2)  # 2 MB
    with big.open("wb") as f:
        f.truncate(2 * 1024**3)
    _rss_growth(small, 2)  # the first loader's one-time costs (imports, allocator pools)
    small_mb, big_mb = _rss_growth(small, 40), _rss_growth(big, 40)
    assert big_mb - small_mb < 200, (big_mb, small_mb)


def test_d16_a_token_id_past_the_sampled_windows_is_refused_before_launch(tmp_path: Path) -> None:
    """Reliability review 2026-11-28 D16: one id of 300 at token 1285 of a 20,000-token file with
    data.num_classes=256 passed the pre-launch check (it samples the first windows) and failed at
    step 3 as a bare IndexError. The check reads every id once and names the file, position and id."""
    from unit_support import checked_run

    ids = np.arange(20_000, dtype=np.uint16) % 256
    ids[1285] = 300
    ids.tofile(tmp_path / "data.bin")
    overrides = (["model=gpt", "data=tokens", f"data.path={tmp_path / 'data.bin'}",
                          "data.num_classes=256", "data.block_size=32", "data.sampling=sequential",
                          "model.dim=16", "model.n_layers=1", "model.n_heads=2", "trainer.batch_size=2"])  # fmt: skip
    with pytest.raises(ConfigError) as err:
        checked_run(overrides, runtime=True)
    assert err.value.key == "data.num_classes"
    assert f"{tmp_path / 'data.bin'} holds id 300 at token 1285" in str(err.value), err.value
    assert "at least 301" in str(err.value)
