"""Hugging Face `datasets` from local files or folders: `data=hf` (the optional extra `disttrain[hf]`).

A folder saved with `Dataset.save_to_disk` is read with `load_from_disk`; data files (JSON lines,
Parquet, text, CSV; one path or a glob) with `load_dataset(format, data_files=...)`. Map-style by
default: an Arrow table memory-mapped from disk, so a rank holds only the rows it reads. With
`streaming=true` the result is an iterable stream that the loader splits by data-parallel rank
(`split_dataset_by_node`) once the strategy knows the ranks (`NodeSplitStream.split_by_node`).

Rows become batch fields: a dict per sample (`input_ids`, `labels`, ...), numbers as tensors
(`with_format("torch")`); a task names the fields (`task.inputs=input_ids task.target=labels`).
`datasets` is imported here only, so disttrain runs without it until `data=hf` is used.
"""

from __future__ import annotations

import glob
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset

from disttrain.config.errors import ConfigError
from disttrain.config.extras import EXTRAS
from disttrain.storage import filesystem, is_url

# Suffix -> the `datasets` builder that reads it.
FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}
BUILDERS = ("json", "parquet", "text", "csv")
ALLOWED_PATHS = (
    "a folder saved with Dataset.save_to_disk, or data files (.json/.jsonl, .parquet, .txt, .csv; "
    "a glob for several)"
)


def load_hf(
    path: str | None,
    split: str = "train",
    format: str | None = None,
    columns: list[str] | None = None,
    map: dict[str, Any] | None = None,
    map_batched: bool = False,
    streaming: bool = False,
    role: str = "train",
    val_split: str | None = None,
    val_path: str | None = None,
    tokenizer: str | None = None,
    block_size: int | None = None,
    packing: bool = False,
    cache_dir: str | None = None,
) -> Any:
    """The `role` (train or val) part of the data set: map-style, or a stream when `streaming`.

    Validation reads `val_path` (its own files, split `split`) or `val_split` of `path`; neither
    set: no validation (None). `map` is a `_target_` spec of a function applied with `Dataset.map`
    (`map_batched`: it takes and returns a batch of rows, dict of lists). `tokenizer`: text rows
    tokenized once, cached (data/tokenize.py); `packing` (or a tokenizer): rows of `block_size`
    tokens (data/packing.py; the pre-launch checks require block_size and map-style data then).
    """
    if role == "val":
        if val_path is None and val_split is None:
            return None
        key = "data.val_path" if val_path is not None else "data.path"
        path, split = (val_path, split) if val_path is not None else (path, str(val_split))
        split_key = "data.split" if val_path is not None else "data.val_split"
    else:
        key, split_key = "data.path", "data.split"
    if not path:
        raise ConfigError(
            key, path, ALLOWED_PATHS, "set data.path=PATH (relative to where you run disttrain)."
        )
    _require_datasets(key)
    try:
        ds = _open(str(path), format, split, streaming, key, split_key)
        if tokenizer:
            from disttrain.data.tokenize import tokenized

            ds = tokenized(ds, str(path), split, tokenizer, cache_dir)
        if map:
            ds = ds.map(_map_function(map), batched=map_batched)
        ds = _select(ds, columns, str(path))
    except ConfigError:
        raise
    except Exception as exc:  # a stream's first rows are read here: a bad JSON line among them
        bad = bad_json_line(str(path)) if format_of_json(str(path), format) else None
        if bad is None:
            raise
        raise ConfigError(
            key,
            path,
            "JSON lines",
            f"{bad}: fix or remove that line ({type(exc).__name__}: {_first_line(exc)}).",
        ) from None
    ds = ds.with_format("torch")
    if streaming:
        return NodeSplitStream(ds, str(path) if format_of_json(str(path), format) else None)
    if packing or tokenizer:
        return _rows(ds, int(block_size or 0), packing)
    return ds


def _rows(ds: Any, block_size: int, packing: bool) -> Any:
    """Packed rows of the documents (one document a row without packing: padded to block_size)."""
    from disttrain.data.packing import PackedRows

    if "input_ids" not in ds.column_names:
        raise ConfigError(
            "data.packing",
            packing,
            f"rows with an input_ids field (token ids; labels too where not every token trains): "
            f"these have {', '.join(ds.column_names)}",
            "set data.tokenizer to tokenize text rows, or keep input_ids in data.columns.",
        )
    return PackedRows(ds, block_size, pack=packing)


def format_of_json(path: str, format: str | None) -> bool:
    """Whether `path` is read as JSON (lines): a bad line in it can be located by bad_json_line."""
    return (format or FORMATS.get(Path(path).suffix.lower())) == "json"


def _require_datasets(key: str) -> None:
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise ConfigError(
            "data",
            "hf",
            "data=hf with the `datasets` package installed",
            EXTRAS["hf"].install + ".",
        ) from None


def _format_of(path: str, format: str | None, key: str) -> str | None:
    """The builder for `path`: data.format, else the files' suffix; None: a saved folder."""
    if format is not None:
        if format not in BUILDERS:
            raise ConfigError(
                "data.format",
                format,
                f"null (from the suffix) or one of {', '.join(BUILDERS)}",
                "json reads JSON lines too; leave it null for a folder saved with save_to_disk.",
            )
        return format
    if not is_url(path) and Path(path).is_dir():
        return None
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ConfigError(
            "data.format",
            None,
            f"one of {', '.join(BUILDERS)} when {key}={path} has no known suffix ({', '.join(FORMATS)})",
            f"set data.format=json (or parquet, text, csv) for {path}.",
        )
    return FORMATS[suffix]


def _matches(path: str) -> list[str]:
    """The files `path` (a file, folder or glob; s3:// or gs:// too) names, or []."""
    if is_url(path):  # an object store: its listing (datasets reads the objects through fsspec)
        scheme, _, key = path.partition("://")
        return [f"{scheme}://{name}" for name in filesystem(path).glob(key)]
    return glob.glob(path)


def _open(path: str, format: str | None, split: str, streaming: bool, key: str, split_key: str) -> Any:
    if not _matches(path):
        raise ConfigError(
            key,
            path,
            ALLOWED_PATHS,
            "nothing is there: check the path (relative to the directory you run disttrain in).",
        )
    builder = _format_of(path, format, key)
    if builder is None:
        return _from_disk(path, split, streaming, key, split_key)
    import datasets

    data_dir = not is_url(path) and Path(path).is_dir()
    try:
        return datasets.load_dataset(
            builder,
            data_dir=path if data_dir else None,
            data_files=None if data_dir else path,
            split=split,
            streaming=streaming,
        )
    except ValueError as exc:  # an unknown split, or a slice a stream cannot take
        raise ConfigError(
            split_key,
            split,
            f"a split of {path}: train (one files entry), or a slice of it such as train[:90%]"
            + (" (slices need streaming=false)" if streaming else ""),
            f"datasets said: {str(exc).splitlines()[0]}",
        ) from None
    except Exception as exc:  # the files are not in the format said, or one line of them is bad
        said = f"{type(exc).__name__}: {_first_line(exc)}"
        bad = bad_json_line(path) if builder == "json" else None
        raise ConfigError(
            key,
            path,
            f"{builder} files (data.format={format})" if format else f"{builder} files, as the suffix says",
            f"datasets could not read them ({said}); "
            + (f"{bad}: fix or remove that line." if bad else "set data.format to the files' real format."),
        ) from None


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or of the one it was raised from (datasets wraps a
    parse error in DatasetGenerationError("An error occurred while generating the dataset"))."""
    cause = exc.__cause__ or exc.__context__
    text = str(exc).strip()
    if cause is not None and "generating the dataset" in text:
        text = f"{text.splitlines()[0]} ({type(cause).__name__}: {str(cause).strip().splitlines()[0]})"
    return text.splitlines()[0] if text else type(exc).__name__


def bad_json_line(path: str) -> str | None:
    """'FILE line N is not JSON (why)' for the first line of the JSON-lines files at `path` (a file,
    a glob or a folder) that does not parse, or None (every line parses, or the files are one JSON
    document each). `datasets` names a row within a chunk, never the file or the line."""
    import json

    if is_url(path):  # reading every object again to find the line: left to datasets' own message
        return None
    root = Path(path)
    files = sorted(root.rglob("*.json*")) if root.is_dir() else sorted(map(Path, glob.glob(path)))
    for file in files:
        if not file.is_file():
            continue
        with open(file, encoding="utf-8", errors="replace") as f:
            first = f.read(1).lstrip()
            f.seek(0)
            if first == "[":  # one JSON array: not JSON lines
                continue
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        json.loads(line)
                    except ValueError as exc:
                        return f"{file} line {number} is not JSON ({str(exc).splitlines()[0]})"
    return None


def _from_disk(path: str, split: str, streaming: bool, key: str, split_key: str) -> Any:
    """A folder from save_to_disk: a Dataset (whose split may be sliced) or a DatasetDict."""
    import datasets

    try:
        saved = datasets.load_from_disk(path)
    except FileNotFoundError as exc:
        raise ConfigError(
            key,
            path,
            ALLOWED_PATHS,
            f"the folder holds no saved data set ({str(exc).splitlines()[0]}); for a folder of data "
            "files set data.format (json, parquet, text or csv).",
        ) from None
    if isinstance(saved, datasets.DatasetDict):
        name, _, _ = split.partition("[")
        if name not in saved:
            raise ConfigError(
                split_key, split, f"a split of {path}: {', '.join(saved)}", "name one of its splits."
            )
        ds = _slice(saved[name], split, name, split_key)
    else:
        name = split.partition("[")[0]
        if name not in ("train", str(saved.split)):
            raise ConfigError(
                split_key,
                split,
                f"train, or a slice of it such as train[:90%] ({path} holds one split)",
                "save a DatasetDict to have named splits, or slice this one: "
                "data.split='train[:90%]' data.val_split='train[90%:]'.",
            )
        ds = _slice(saved, split, name, split_key)
    return ds.to_iterable_dataset() if streaming else ds


def _slice(ds: Any, spec: str, name: str, split_key: str) -> Any:
    """`name[a:b]` (rows or percent, as `load_dataset` reads them) of a saved split."""
    if "[" not in spec:
        return ds
    import datasets

    try:
        (part,) = datasets.ReadInstruction.from_spec(spec).to_absolute({name: len(ds)})
    except (ValueError, AssertionError) as exc:
        raise ConfigError(
            split_key, spec, "a split name, or a slice of it such as train[:90%]", str(exc).splitlines()[0]
        ) from None
    return ds.select(range(part.from_, part.to))


def _map_function(spec: dict[str, Any]) -> Callable[..., Any]:
    """data.map as a function: its `_target_` with the other keys bound (a partial)."""
    from omegaconf import DictConfig, OmegaConf

    from disttrain.config.instantiate import build

    node = OmegaConf.to_container(spec, resolve=True) if isinstance(spec, DictConfig) else dict(spec)
    if not isinstance(node, dict) or "_target_" not in node:
        raise ConfigError(
            "data.map", spec, "null or a node with _target_", "data.map._target_=mylab.prep.add_labels"
        )
    return build({**node, "_partial_": True}, "data.map")


def _select(ds: Any, columns: list[str] | None, path: str) -> Any:
    """Keep the `columns` (all when None); a missing one is named with those the set has."""
    if columns is None:
        return ds
    have = ds.column_names
    if have is None:  # a stream of JSON lines knows its columns once a row is read
        have = list(next(iter(ds)).keys())
    missing = [c for c in columns if c not in have]
    if missing:
        raise ConfigError(
            "data.columns",
            list(columns),
            f"columns of {path}: {', '.join(have)}",
            f"{missing[0]} is not one of them; list the fields the task reads, or null for all"
            " (data.map may add columns first).",
        )
    return ds.select_columns(list(columns))


class NodeSplitStream(IterableDataset):
    """A `datasets` stream that each data-parallel rank reads its own part of.

    The data set is built before the strategy knows the data-parallel ranks (pipeline and tp ranks
    share data), so the split happens when the loader is made (`split_by_node`); until then the
    whole stream is read (the checks in the launcher). `split_dataset_by_node` hands out whole
    files when their count divides the ranks, else every `size`-th row: disjoint either way.
    Loader workers split a rank's part again by file (`datasets` does it itself).
    """

    def __init__(self, stream: Any, json_path: str | None = None) -> None:
        self.stream = stream
        self.part = stream
        self.json_path = json_path  # JSON-lines files: a row that does not parse is found by line

    def split_by_node(self, rank: int, size: int) -> None:
        from datasets.distributed import split_dataset_by_node

        self.part = split_dataset_by_node(self.stream, rank=rank, world_size=size)

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self.part
        except Exception as exc:
            bad = bad_json_line(self.json_path) if self.json_path else None
            if bad is None:
                raise
            raise ValueError(
                f"data.path={self.json_path}: {bad} ({type(exc).__name__}: {_first_line(exc)})"
            ) from exc

    def set_epoch(self, epoch: int) -> None:
        self.part.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is (`datasets` tracks shard and row): exact resume of this rank's part."""
        return self.part.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.part.load_state_dict(state)
