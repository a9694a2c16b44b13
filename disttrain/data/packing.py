"""Packed rows: several documents in one row of `block_size` tokens (`data.packing=true`).

A row is a dict of three equal-length int64 tensors, Hugging Face's packed format
(`DataCollatorWithFlattening`):

- `input_ids`: the documents one after the other, then padding up to `block_size`;
- `position_ids`: 0, 1, ... restarting at each document (and at the padding): where a document
  starts is where the position does not follow the one before, which is how the built-in gpt
  (a block-diagonal causal mask) and Hugging Face models (`find_packed_sequence_indices`) keep
  attention inside a document;
- `labels`: unshifted (a model predicts label i + 1 at position i), IGNORE (-100) at each
  document's first token (nothing in its own document predicts it), at prompt tokens and at the
  padding: the loss is over the real tokens only.

`PackedRows` packs a map-style data set of documents (rows with `input_ids` and optionally
`labels`) in their order, next-fit: a document goes into the current row when it fits, else it
starts the next one. The table (row -> first and last document) is computed once from the
documents' lengths, so rows are indexable and a resume is the sampler's position, as for any
map-style data set. `data.packing=false` with a tokenizer pads each document to its own row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

IGNORE = -100  # torch's CrossEntropyLoss ignore_index and Hugging Face's label for "not trained"
FIELDS = ("input_ids", "labels", "position_ids")


def doc_positions(starts: torch.Tensor) -> torch.Tensor:
    """Positions restarting at every True of `starts` (a bool vector; index 0 always starts)."""
    n = starts.numel()
    idx = torch.arange(n)
    begin = torch.where(starts, idx, torch.zeros_like(idx))
    begin[0] = 0
    return idx - torch.cummax(begin, dim=0).values


def row(
    docs: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """One packed row of `docs` ((ids, labels) each, labels unshifted), padded to `block_size`."""
    ids = torch.full((block_size,), pad_id, dtype=torch.int64)
    labels = torch.full((block_size,), IGNORE, dtype=torch.int64)
    starts = torch.zeros(block_size, dtype=torch.bool)
    at = 0
    for doc_ids, doc_labels in docs:
        n = min(len(doc_ids), block_size - at)
        ids[at : at + n] = doc_ids[:n]
        labels[at : at + n] = doc_labels[:n]
        labels[at] = IGNORE  # nothing in its document predicts a document's first token
        starts[at] = True
        at += n
    if at < block_size:
        starts[at] = True  # the padding is a document of its own: no real token attends to it
    return {"input_ids": ids, "labels": labels, "position_ids": doc_positions(starts)}


def next_fit(lengths: np.ndarray, block_size: int) -> np.ndarray:
    """Where each row starts (document indices, plus the end): documents in order, a new row when
    the next one does not fit; a document longer than a row is cut to `block_size`."""
    bounds, used = [0], 0
    for i, n in enumerate(np.minimum(lengths, block_size).tolist()):
        if used and used + n > block_size:
            bounds.append(i)
            used = 0
        used += n
    if len(lengths):
        bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


class PackedRows(Dataset):
    """Rows of documents from a map-style data set whose items hold `input_ids` (a list or 1-d
    tensor of ids) and optionally `labels` (unshifted, IGNORE where not trained). `pack=False`:
    one document per row (padding to `block_size`, the baseline packing is measured against)."""

    def __init__(self, docs: Any, block_size: int, pack: bool = True, pad_id: int = 0) -> None:
        self.docs, self.block_size, self.pad_id = docs, block_size, pad_id
        lengths = document_lengths(docs)
        self.bounds = next_fit(lengths, block_size) if pack else np.arange(len(lengths) + 1)
        self.real = int(np.minimum(lengths, block_size).sum())  # tokens in all rows, padding excluded

    def __len__(self) -> int:
        return max(0, len(self.bounds) - 1)

    def pad_fraction(self) -> float:
        """The share of all rows' places that are padding."""
        return 1.0 - self.real / max(1, len(self) * self.block_size)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        docs = []
        for k in range(int(self.bounds[i]), int(self.bounds[i + 1])):
            item = self.docs[k]
            ids = torch.as_tensor(item["input_ids"], dtype=torch.int64)
            labels = item.get("labels")
            docs.append((ids, ids if labels is None else torch.as_tensor(labels, dtype=torch.int64)))
        return row(docs, self.block_size, self.pad_id)


def document_lengths(docs: Any) -> np.ndarray:
    """Each document's token count: from the Arrow column when the data set has one (no rows are
    decoded), else by reading every item."""
    data = getattr(docs, "data", None)
    if data is not None and hasattr(data, "column") and "input_ids" in getattr(docs, "column_names", ()):
        import pyarrow.compute as pc

        column = data.column("input_ids")
        indices = getattr(docs, "_indices", None)  # a select()ed data set: the rows it maps to
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        if indices is not None:
            lengths = lengths[indices.column(0).to_numpy()]
        return np.asarray(lengths, dtype=np.int64)
    return np.asarray([len(docs[i]["input_ids"]) for i in range(len(docs))], dtype=np.int64)


def window_row(window: torch.Tensor, eos_id: int) -> dict[str, torch.Tensor]:
    """A packed row of a `data=tokens` window: documents end with `eos_id` (the EOS belongs to the
    document it ends), the next one starts after it; the window's first token starts one too."""
    starts = torch.zeros(window.numel(), dtype=torch.bool)
    starts[0] = True
    starts[1:] = window[:-1] == eos_id
    labels = window.clone()
    labels[starts] = IGNORE
    return {"input_ids": window, "labels": labels, "position_ids": doc_positions(starts)}


def is_packed(batch: Any) -> bool:
    """A batch of packed rows (see the module docstring): a mapping holding the three fields."""
    from collections.abc import Mapping

    return isinstance(batch, Mapping) and all(f in batch for f in FIELDS)
