"""Reading DCP shards safely: `.metadata` unpickled through an allow-list of DCP's own classes,
shards checked against the manifest as they are read (`reading`)."""

from __future__ import annotations

import functools
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import torch

from disttrain.checkpoint.layout import MANIFEST
from disttrain.checkpoint.reading import (
    CorruptCheckpoint,
    open_regular,
    refuse_compressed,
    storage_problem,
)
from disttrain.storage import ObjectPath

log = logging.getLogger("disttrain")

# Exactly the globals DCP writes into `.metadata` (read off torch 2.13's own checkpoints): a pickle
# can call any global it names, so only these (module, name) pairs resolve, never a whole module.
# A dotted name (pickle protocol 4 walks attributes: `metadata` + "os.system" -> os.system) or a
# dunder never matches an entry, and torch's dtypes are looked up by exact name, not by getattr.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", n)
            for n in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # a dict lookup of torch's layouts by name
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "Path"),
        ("collections", "OrderedDict"),
    }
)


@functools.cache
def _dtype_names() -> frozenset[str]:
    return frozenset(n for n, v in vars(torch).items() if isinstance(v, torch.dtype) and n.isidentifier())


class _SafeUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle: resolve only the exact globals DCP itself writes there."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and name in _dtype_names():  # torch.float32, torch.bfloat16, ...
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


def _reader(
    path: Path | ObjectPath, expected: dict[str, Any] | None = None, check_unread: bool = False
) -> Any:
    """DCP's FileSystemReader with `.metadata` through the allow-list and `reading.read_data`:
    one thread per file, whole tensors read straight into the live ones, and each file checked
    against its manifest entry in `expected` (those it reads; with `check_unread`, the rest too)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    from disttrain.checkpoint import reading

    remote = isinstance(path, ObjectPath)

    class SafeReader(FsspecReader if remote else FileSystemReader):  # type: ignore[misc]
        location: Path | ObjectPath = path  # the folder, as a Path or an ObjectPath (self.path: DCP's)
        expected: dict[str, Any] | None = None
        check_unread = False
        metadata: Any = None

        def read_data(self, plan: Any, planner: Any) -> Any:
            return reading.read_data(self, plan, planner)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            if rank is None and self.metadata is not None:  # read before dcp.load (`load_sharded`)
                self.metadata.storage_meta.load_id = self.load_id
                return self.metadata
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with open_regular(self.location / name) as f:
                metadata = _SafeUnpickler(f).load()
            if why := storage_problem(metadata, self._listed()):
                raise CorruptCheckpoint(f"checkpoint {self.path}: {why}")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def _listed(self) -> Any:
            """The manifest's file names (None: a checkpoint without a manifest, or an unreadable one:
            the load's own manifest check names that)."""
            if self.expected is not None:
                return self.expected
            try:
                return json.loads((self.location / MANIFEST).read_text())["files"]
            except (OSError, ValueError, KeyError, TypeError):
                return None

    r = SafeReader(str(path))
    r.expected, r.check_unread = expected, check_unread
    return r


def _planner() -> Any:
    import io

    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner, but non-tensor values load with weights_only=True."""

        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._traverse import set_element

            refuse_compressed(value, f"item {read_item.dest_index.fqn}")
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()
