"""The built-in data sets' specs and typed configs (torch-free): `data=digits|synthetic|text|files|
tokens|hf|mix`.

Each config extends the schema's `DataConfig` (the keys every data set has) and is stored in Hydra's
ConfigStore as `data/base_<name>`; a YAML under `configs/data/` fills values. Data of yours needs no
spec (`data.train._target_=mylab.load`); a package that ships a data set with a schema registers a
`TargetSpec` in `DATA` through the `disttrain.data` entry-point group, plus one `data/<name>.yaml`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import II, MISSING

from disttrain.config.common import Choice
from disttrain.config.common import help_field as _h
from disttrain.config.errors import ConfigError
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
    num_samples: int = _h("training samples to generate", 2048, at_least=1)
    num_val_samples: int = _h("validation samples to generate (0: none)", 512, at_least=0)
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
    block_size: int = _h("tokens per sample (the model's context length)", 64, at_least=1)
    val_fraction: float = _h("the file's last fraction validates", 0.1)
    num_features: int = II("data.block_size")
    num_classes: int = 256
    train: Any = _text("train")
    val: Any = _text("val")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fraction(self.val_fraction)


def check_fraction(fraction: Any) -> None:
    """data.val_fraction: the share of the data that validates."""
    if fraction is None or not 0.0 <= fraction < 1.0:
        raise ConfigError(
            "data.val_fraction",
            fraction,
            "a fraction in [0, 1)",
            "the share of the data that validates, e.g. 0.1; 0 validates on nothing.",
        )


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
    block_size: int = _h("tokens per sample (the model's context length)", 256, at_least=1)
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

    def __post_init__(self) -> None:
        super().__post_init__()
        self.dtype = TokenDtype.of("data.dtype", self.dtype)
        self.sampling = Sampling.of("data.sampling", self.sampling)
        check_fraction(self.val_fraction)
        if self.packing and self.eos_id is None:
            raise ConfigError(
                "data.eos_id",
                None,
                "the token id that ends each document in the token files, with data.packing=true",
                "set data.eos_id (GPT-2's <|endoftext|> is 50256, what nanoGPT's prepare.py appends).",
            )

    @property
    def rows(self) -> tuple[str, Any] | None:
        return ("data.packing", True) if self.packing else None


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
    block_size: int | None = _h("tokens per row with data.tokenizer or data.packing", None, at_least=1)
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

    @property
    def rows(self) -> tuple[str, Any] | None:
        if self.packing:
            return "data.packing", True
        return ("data.tokenizer", self.tokenizer) if self.tokenizer else None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rows and self.block_size is None:
            raise ConfigError(
                "data.block_size", None, "a number >= 1", "tokens per row, e.g. data.block_size=64."
            )
        if self.rows and self.streaming:
            raise ConfigError(
                *self.rows,
                "false with data.streaming=true (rows are packed from a map-style data set's lengths)",
                "set data.streaming=false (Arrow files are memory-mapped: a large set needs no stream), "
                "or pack and tokenize beforehand.",
            )
        if self.streaming and self.shard == "auto":
            raise ConfigError(
                "data.shard",
                "auto",
                "none with data.streaming=true",
                "data=hf splits its stream by data-parallel rank itself (split_dataset_by_node) and its "
                "loader workers by file; auto would split each part again and drop samples.",
            )

    def check_run(self, run: Any) -> None:
        if self.streaming and run.trainer.max_steps == -1:
            raise ConfigError(
                "trainer.max_steps",
                -1,
                ">= 1 with data.streaming=true",
                "a stream has no length, so an epoch count cannot say when training ends: set "
                "trainer.max_steps=N (optimizer steps), or data.streaming=false.",
            )
        super().check_run(run)


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


def option_of(node: Mapping[str, Any]) -> DataConfig | None:
    """The data option a data node was composed from (its `name`, a registered one), typed and so
    checked: None for data of yours. Built from the node's keys as they are (not through OmegaConf,
    which would merge a swapped data.val into the option's own one)."""
    try:
        cls = DATA.get(str(node.get("name"))).config  # a name of yours: the entry points are read once
    except ConfigError:
        return None
    names = {f.name for f in fields(cls)}
    option: DataConfig = cls(**{k: v for k, v in node.items() if k in names})
    return option
