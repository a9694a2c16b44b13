"""data=hf: Hugging Face `datasets` from a saved folder and from JSON lines, map-style and streamed,
split by data-parallel rank; its mistakes as one paragraph naming the key. In process, no network."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from unit_support import checked, write_module

from disttrain.config.errors import ConfigError
from disttrain.config.run import Run
from disttrain.data import build_datasets
from disttrain.data.loaders import make_loaders
from disttrain.dist import DistEnv

pytest.importorskip("datasets")

HF = ("model=gpt", "data=hf", "data.num_features=8", "data.num_classes=16")
PREP = """
def add_labels(row, shift=1):
    return {"labels": [(t + shift) % 16 for t in row["input_ids"]]}


def add_labels_batched(rows):
    return {"labels": [[(t + 1) % 16 for t in ids] for ids in rows["input_ids"]]}
"""


def rows(n: int = 40) -> list[dict[str, Any]]:
    """Row i: input_ids i, i+1, ... (mod 16), a string column and the row's number."""
    return [{"input_ids": [(i + k) % 16 for k in range(8)], "text": f"row {i}", "i": i} for i in range(n)]


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`load_dataset` writes its Arrow cache under tmp_path, not the user's home."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    return path


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    from datasets import Dataset

    Dataset.from_list(rows()).save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved"


def build(*overrides: str) -> tuple[Any, Any]:
    return build_datasets(checked([*HF, *overrides])["data"])


@pytest.mark.parametrize("source", ["saved", "jsonl"])
def test_rows_become_tensor_fields_of_the_chosen_columns(source: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(source)
    train, val = build(f"data.path={path.name}", "data.columns=[input_ids,i]")
    assert val is None and len(train) == 40
    sample = train[3]
    assert set(sample) == {"input_ids", "i"}
    assert torch.equal(sample["input_ids"], torch.tensor([(3 + k) % 16 for k in range(8)]))
    loader = torch.utils.data.DataLoader(train, batch_size=4)
    batch = next(iter(loader))
    assert batch["input_ids"].shape == (4, 8) and batch["input_ids"].dtype == torch.int64
    assert batch["i"].tolist() == [0, 1, 2, 3]


def test_validation_from_a_slice_or_a_second_file(saved: Path, jsonl: Path) -> None:
    train, val = build("data.path=saved", "data.split='train[:75%]'", "data.val_split='train[75%:]'")
    assert [int(r["i"]) for r in train] == list(range(30)) and [int(r["i"]) for r in val] == list(
        range(30, 40)
    )
    train, val = build("data.path=saved", "data.val_path=rows.jsonl")
    assert len(train) == len(val) == 40 and set(val[0]) == {"input_ids", "text", "i"}


@pytest.mark.parametrize("batched", [False, True])
def test_map_by_target_adds_a_field(saved: Path, tmp_path: Path, batched: bool) -> None:
    write_module(tmp_path, "mylab.prep", PREP)
    sys.path.insert(0, str(tmp_path))
    try:
        fn = "mylab.prep.add_labels_batched" if batched else "mylab.prep.add_labels"
        extra = () if batched else ("data.map.shift=1",)
        train, _ = build("data.path=saved", f"data.map._target_={fn}", *extra, f"data.map_batched={batched}")
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("mylab")]:
            del sys.modules[name]
    assert torch.equal(train[5]["labels"], (train[5]["input_ids"] + 1) % 16)


@pytest.mark.parametrize("source", ["saved", "jsonl"])
def test_a_stream_is_split_by_data_parallel_rank(source: str, request: pytest.FixtureRequest) -> None:
    """Each data-parallel rank of the loader reads its own rows; together all of them, once."""
    path = request.getfixturevalue(source)
    over = (f"data.path={path.name}", "data.streaming=true", "trainer.max_steps=5", "data.columns=[i]")
    cfg = checked([*HF, *over])
    whole, _ = build_datasets(cfg["data"])
    assert [int(r["i"]) for r in whole] == list(range(40))  # the launcher's checks read it unsplit
    seen = []
    for rank in range(2):
        stream, _ = build_datasets(cfg["data"])
        stream.split_by_node(rank, 2)
        seen.append([int(r["i"]) for r in stream])
    assert sorted(seen[0] + seen[1]) == list(range(40)) and not set(seen[0]) & set(seen[1])
    assert abs(len(seen[0]) - len(seen[1])) <= 1


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_a_streamed_rank_resumes_at_the_next_batch(jsonl: Path) -> None:
    """The rank's stream position (datasets' own state_dict, kept by StatefulDataLoader in each
    checkpoint) restores the rest of its part exactly: batches 3.. of a fresh read."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    cfg = checked(
        [*HF, "data.path=rows.jsonl", "data.streaming=true", "trainer.max_steps=5", "data.columns=[i]"]
    )

    def loader() -> StatefulDataLoader:
        stream, _ = build_datasets(cfg["data"])
        stream.split_by_node(1, 2)
        return StatefulDataLoader(stream, batch_size=4)

    whole = [b["i"].tolist() for b in loader()]
    assert whole[0] == [1, 3, 5, 7] and len(whole) == 5
    first = loader()
    batches = iter(first)
    seen = [next(batches)["i"].tolist() for _ in range(2)]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert seen + [b["i"].tolist() for b in resumed] == whole


def test_make_loaders_splits_a_stream_by_the_strategy_ranks(saved: Path) -> None:
    """The split takes the strategy's data-parallel (rank, size), not the world's."""

    class Stream(torch.utils.data.IterableDataset):
        def __init__(self) -> None:
            self.split: tuple[int, int] | None = None

        def split_by_node(self, rank: int, size: int) -> None:
            self.split = (rank, size)

        def __iter__(self) -> Any:
            return iter(())

    cfg = checked([*HF, "data.path=saved"])
    env = DistEnv(
        rank=3, local_rank=3, world_size=4, local_world_size=4, backend="gloo", device=torch.device("cpu")
    )
    train, val = Stream(), Stream()
    make_loaders(Run.of(cfg), env, train, val, dp_rank_size=(1, 2))
    assert train.split == val.split == (1, 2)


# fmt: off
BAD = [
    ("missing-path", ("data.path=nope.jsonl",), "data.path", "nope.jsonl"),
    ("unknown-column", ("data.path=rows.jsonl", "data.columns=[input_ids,lables]"), "data.columns",
     "['input_ids', 'lables']"),
    ("unknown-format", ("data.path=rows.jsonl", "data.format=xml"), "data.format", "xml"),
    ("unknown-split", ("data.path=saved", "data.split=test"), "data.split", "test"),
    ("missing-val-file", ("data.path=saved", "data.val_path=val.jsonl"), "data.val_path", "val.jsonl"),
    ("map-target", ("data.path=saved", "data.map._target_=no.such.fn"), "data.map._target_", "no.such.fn"),
]
# fmt: on


@pytest.mark.parametrize(("argv", "key", "value"), [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_mistakes_name_the_key(saved: Path, jsonl: Path, argv: tuple[str, ...], key: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        build(*argv)
    assert (err.value.key, str(err.value.value)) == (key, value), err.value


def test_a_stream_without_max_steps_is_refused_before_anything_is_read() -> None:
    with pytest.raises(ConfigError) as err:
        checked([*HF, "data.path=nothing/yet", "data.streaming=true"])
    assert err.value.key == "trainer.max_steps" and "data.streaming=true" in str(err.value)


def test_a_stream_split_by_rank_is_not_split_again() -> None:
    with pytest.raises(ConfigError) as err:
        checked([*HF, "data.path=x.jsonl", "data.streaming=true", "trainer.max_steps=5", "data.shard=auto"])
    assert (err.value.key, err.value.value) == ("data.shard", "auto")


def test_without_datasets_installed_the_error_names_the_extra(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(ConfigError) as err:
        build("data.path=saved")
    assert err.value.key == "data" and "disttrain[hf]" in str(err.value)


def _one_bad_line(tmp_path: Path, n: int = 351, bad: int = 301) -> Path:
    lines = [json.dumps(r) for r in rows(n)]
    lines[bad - 1] = '{"input_ids": [1, 2], : 3}'
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_d22_a_malformed_json_line_is_named_by_file_and_line_map_style(tmp_path: Path) -> None:
    """Reliability review 2026-11-28 D22: the paragraph said "set data.format to the files' real
    format" for JSON lines with one bad line."""
    path = _one_bad_line(tmp_path)
    with pytest.raises(ConfigError) as err:
        build(f"data.path={path.name}")
    text = str(err.value)
    assert err.value.key == "data.path" and f"{path.name} line 301 is not JSON" in text, text
    assert "real format" not in text


def test_d22_a_malformed_json_line_is_named_by_file_and_line_streaming(tmp_path: Path) -> None:
    """Streaming, the bad line past the first chunk: the rank failed with "JSON parse error ... in
    row 90" at step 26, naming neither the file nor line 301. In the first chunk (read by the
    pre-launch checks) it is a paragraph; past it, the rank's error names the file and line."""
    from disttrain.data.hf import NodeSplitStream

    path = _one_bad_line(tmp_path)
    with pytest.raises(ConfigError, match=r"bad\.jsonl line 301 is not JSON"):
        build(f"data.path={path.name}", "data.streaming=true", "trainer.max_steps=5", "data.columns=[i]")

    class Chunked:  # datasets' stream, failing at its second chunk as ArrowInvalid does
        def __iter__(self) -> Any:
            yield from ({"i": i} for i in range(90))
            raise RuntimeError("JSON parse error: Missing a name for object member. in row 90")

    stream = NodeSplitStream(Chunked(), json_path=str(path))
    with pytest.raises(ValueError, match=r"bad\.jsonl line 301 is not JSON") as err:
        for _ in stream:
            pass
    assert "in row 90" in str(err.value)  # datasets' own words kept beside
