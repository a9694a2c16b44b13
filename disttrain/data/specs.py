"""The built-in data sets' specs and typed configs (torch-free): `data=digits|synthetic|text|files|
tokens|hf|mix`.

Each config extends the schema's `DataConfig` (the keys every data set has) and is stored in Hydra's
ConfigStore as `data/base_<name>`; a YAML under `configs/data/` fills values. Data of yours needs no
spec (`data.train._target_=mylab.load`); a package that ships a data set with a schema registers a
`TargetSpec` in `DATA` through the `disttrain.data` entry-point group, plus one `data/<name>.yaml`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import II, MISSING

from disttrain.config.common import Choice
from disttrain.config.common import help_field as _h
from disttrain.config.registry import Registry, TargetSpec, target_registry
from disttrain.config.schema import DataConfig

DATA: Registry[TargetSpec] = target_registry(
    "data",
    key="data",
    module="disttrain.data.specs",
    hint="choose a data group option (data=text), or your own: data.train._target_=mylab.load.",
)


def _digits(split: str) -> Any:
    """load_digits' node for one split: both splits cut the same shuffle at the same fraction."""
    return field(
        default_factory=lambda: {
            "_target_": "disttrain.data.digits.load_digits",
            "split": split,
            "val_fraction": 0.2,
            "seed": 0,
        }
    )


@dataclass
class DigitsDataConfig(DataConfig):
    name: str = "digits"
    num_features: int = 64
    num_classes: int = 10
    train: Any = _digits("train")
    val: Any = _digits("val")


def _synthetic(split: str, size: str) -> Any:
    """make_synthetic's node for one split, wired to the data keys: the splits differ in size only."""
    return field(
        default_factory=lambda: {
            "_target_": "disttrain.data.synthetic.make_synthetic",
            "num_samples": II(f"data.{size}"),
            "num_features": II("data.num_features"),
            "num_classes": II("data.num_classes"),
            "noise": II("data.noise"),
            "seed": II("data.seed"),
            "targets": II("data.targets"),
            "split": split,
        }
    )


@dataclass
class SyntheticDataConfig(DataConfig):
    name: str = "synthetic"
    num_features: int = 32
    num_classes: int = 4
    num_samples: int = _h("training samples", 2048)
    num_val_samples: int = _h("validation samples", 512)
    noise: float = _h("std of the noise added around each class centre", 1.0)
    seed: int = _h("seed of the generated data (independent of the run seed)", 1234)
    train: Any = _synthetic("train", size="num_samples")
    val: Any = _synthetic("val", size="num_val_samples")


def _text(split: str) -> Any:
    """load_text's node for one split, wired to the data keys."""
    return field(
        default_factory=lambda: {
            "_target_": "disttrain.data.text.load_text",
            "path": II("data.path"),
            "block_size": II("data.block_size"),
            "val_fraction": II("data.val_fraction"),
            "split": split,
        }
    )


@dataclass
class TextDataConfig(DataConfig):
    name: str = "text"
    path: str | None = _h("a text file (bytes are tokens); null: the shipped Python reference corpus", None)
    block_size: int = _h("tokens per sample (the model's context length)", 64)
    val_fraction: float = _h("the file's last fraction validates", 0.1)
    num_features: int = II("data.block_size")
    num_classes: int = 256
    train: Any = _text("train")
    val: Any = _text("val")


def _files(path: str) -> Any:
    """load_files' node for one split: the arrays at data.<path>."""
    return field(
        default_factory=lambda: {
            "_target_": "disttrain.data.files.load_files",
            "path": II(f"data.{path}"),
            "targets": II("data.targets"),
        }
    )


@dataclass
class FilesDataConfig(DataConfig):
    name: str = "files"
    path: str = _h(
        "training arrays: .npz (keys x, y), .pt (dict x, y or tuple) or .csv (label last)", MISSING
    )
    val_path: str | None = _h("validation arrays in the same format; null: no validation", None)
    train: Any = _files("path")
    val: Any = _files("val_path")


def _tokens(split: str) -> Any:
    """load_tokens' node for one split, wired to the data keys."""
    return field(
        default_factory=lambda: {
            "_target_": "disttrain.data.tokens.load_tokens",
            "path": II("data.path"),
            "block_size": II("data.block_size"),
            "dtype": II("data.dtype"),
            "sampling": II("data.sampling"),
            "val_path": II("data.val_path"),
            "val_fraction": II("data.val_fraction"),
            "seed": II("seed"),
            "packing": II("data.packing"),
            "eos_id": II("data.eos_id"),
            "split": split,
        }
    )


PACKING_HELP = (
    "pack documents into rows of block_size tokens: positions restart and attention stays within each "
    "document, the loss is over real tokens only (samples become dicts: input_ids, labels, position_ids)"
)


class TokenDtype(Choice):
    uint16 = "uint16"
    uint32 = "uint32"


class Sampling(Choice):
    random = "random"
    sequential = "sequential"


@dataclass
class TokensDataConfig(DataConfig):
    name: str = "tokens"
    path: str = _h("a token file (nanoGPT's .bin: raw little-endian ids) or a glob of shards", MISSING)
    dtype: TokenDtype = _h("the ids' type: uint16 (vocab <= 65536) or uint32", TokenDtype.uint16)
    block_size: int = _h("tokens per sample (the model's context length)", 256)
    sampling: Sampling = _h(
        "random (nanoGPT's windows at random offsets, drawn from seed and sample index) or sequential "
        "(non-overlapping windows in order)",
        Sampling.random,
    )
    val_path: str | None = _h(
        "a validation token file or glob (read in order); null: the held-out tail", None
    )
    val_fraction: float = _h("with no val_path: the last fraction of the tokens validates (0: none)", 0.0)
    num_features: int = II("data.block_size")
    num_classes: int = _h("vocabulary size (the model's output width): above the largest token id", 50304)
    shuffle: bool = _h("reorder the windows every epoch (random sampling is random already)", False)
    packing: bool = _h(PACKING_HELP + "; documents end with data.eos_id", False)
    eos_id: int | None = _h("the token id that ends each document (data.packing=true)", None)
    train: Any = _tokens("train")
    val: Any = _tokens("val")


def _hf(role: str) -> Any:
    """load_hf's node for one role (train or val), wired to the data keys. `data.map` is built by
    load_hf itself (as a function, not called), so Hydra must not instantiate it first."""
    return field(
        default_factory=lambda: {
            "_target_": "disttrain.data.hf.load_hf",
            "_recursive_": False,
            "path": II("data.path"),
            "format": II("data.format"),
            "split": II("data.split"),
            "columns": II("data.columns"),
            "map": II("data.map"),
            "map_batched": II("data.map_batched"),
            "streaming": II("data.streaming"),
            "val_split": II("data.val_split"),
            "val_path": II("data.val_path"),
            "tokenizer": II("data.tokenizer"),
            "block_size": II("data.block_size"),
            "packing": II("data.packing"),
            "cache_dir": II("data.cache_dir"),
            "role": role,
        }
    )


@dataclass
class HFDataConfig(DataConfig):
    name: str = "hf"
    path: str = _h(
        "a folder saved with Dataset.save_to_disk, or data files (.json/.jsonl, .parquet, .txt, .csv; "
        "a glob for several)",
        MISSING,
    )
    format: str | None = _h(
        "json, parquet, text or csv; null: from the suffix (a folder: save_to_disk)", None
    )
    split: str = _h("the training split: a name (a saved DatasetDict's), or a slice: train[:90%]", "train")
    val_split: str | None = _h(
        "validation from the same source: a split name or a slice (train[90%:]); null: none", None
    )
    val_path: str | None = _h("validation from its own folder or files (split data.split); null: none", None)
    columns: list[str] | None = _h("the columns that become batch fields; null: all", None)
    map: Any = _h(
        "a function applied to every row with Dataset.map, by _target_ (its other keys are bound); "
        "empty or null: none",
        factory=dict,
    )
    map_batched: bool = _h("data.map takes and returns a batch of rows (a dict of lists)", False)
    streaming: bool = _h(
        "read as a stream (an IterableDataset split by data-parallel rank); needs trainer.max_steps", False
    )
    tokenizer: str | None = _h(
        "a tokenizer folder (AutoTokenizer.from_pretrained): rows with text, prompt + completion or chat "
        "messages are tokenized once (cached in data.cache_dir), the loss masked on prompt tokens",
        None,
    )
    block_size: int | None = _h("tokens per row with data.tokenizer or data.packing", None)
    packing: bool = _h(PACKING_HELP, False)
    cache_dir: str | None = _h(
        "where tokenized data is cached, one folder per hash of the files, tokenizer and settings; "
        "null: ~/.cache/disttrain/tokenized",
        None,
    )
    num_features: int | None = _h(
        "sequence length the model sees (model=gpt reads it); default: data.block_size", II("data.block_size")
    )
    num_classes: int | None = _h(
        "vocabulary size (model=gpt reads it); not needed by a model that knows its own (task=model_loss)",
        None,
    )
    train: Any = _hf("train")
    val: Any = _hf("val")


def _mix() -> Any:
    """load_mix's node: it builds each source itself (naming data.mix.<name> in errors)."""
    return field(
        default_factory=lambda: {
            "_target_": "disttrain.data.mix.load_mix",
            "_recursive_": False,
            "sources": II("data.mix"),
            "size": II("data.size"),
            "seed": II("data.seed"),
        }
    )


@dataclass
class MixDataConfig(DataConfig):
    name: str = "mix"
    mix: dict[str, Any] = _h(
        "the sources by name: each a data set spec (_target_ and its keys, or builtin: synthetic/text/"
        "digits/files/hf with their keys) plus weight (its share of the samples)",
        factory=dict,
    )
    size: int | None = _h(
        "samples in one epoch of the mixture; null: the most without repeating a source", None
    )
    seed: int = _h(
        "seed of which sample of which source comes where (independent of the sources)", II("seed")
    )
    train: Any = _mix()


DIGITS = DATA.register(
    TargetSpec(
        "digits", DigitsDataConfig, "disttrain.data.digits.load_digits", "8x8 handwritten digits (shipped)"
    )
)
SYNTHETIC = DATA.register(
    TargetSpec(
        "synthetic", SyntheticDataConfig, "disttrain.data.synthetic.make_synthetic", "Gaussian classes"
    )
)
TEXT = DATA.register(
    TargetSpec("text", TextDataConfig, "disttrain.data.text.load_text", "a text file as byte tokens")
)
FILES = DATA.register(
    TargetSpec("files", FilesDataConfig, "disttrain.data.files.load_files", "arrays from .npz, .pt or .csv")
)
TOKENS = DATA.register(
    TargetSpec("tokens", TokensDataConfig, "disttrain.data.tokens.load_tokens", "nanoGPT token files")
)
HF = DATA.register(
    TargetSpec("hf", HFDataConfig, "disttrain.data.hf.load_hf", "a Hugging Face datasets source")
)
MIX = DATA.register(TargetSpec("mix", MixDataConfig, "disttrain.data.mix.load_mix", "weighted sources mixed"))
