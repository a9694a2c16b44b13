"""`data=mix`: several data sets in one, each sample's source fixed by a table from the seed.

The table maps every index of the mixture to (source, index in the source): source i gets
round(size x weight_i) places (largest remainders, so the shares are exact), filled with
successive permutations of its samples (a small source repeats, a large one is cut), and the
places are shuffled together. The mixture is then a plain map-style data set: the loader's
ResumableSampler orders it, so a run resumes exactly as with any other map-style data, and the
same seed and weights give the same mixture at any world size.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from disttrain.config.errors import ConfigError

# builtin: NAME in a source -> the factory of that built-in data set.
BUILTINS = {
    "synthetic": "disttrain.data.synthetic.make_synthetic",
    "text": "disttrain.data.text.load_text",
    "digits": "disttrain.data.digits.load_digits",
    "files": "disttrain.data.files.load_files",
    "hf": "disttrain.data.hf.load_hf",
}


def mixture_table(
    lengths: list[int], weights: list[float], size: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(source, index) of each of the `size` places of the mixture; a pure function of its inputs."""
    total = float(sum(weights))
    exact = [size * w / total for w in weights]
    counts = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: size - sum(counts)]:
        counts[i] += 1
    g = torch.Generator().manual_seed(seed)
    sources, indices = [], []
    for i, (n, length) in enumerate(zip(counts, lengths, strict=True)):
        repeats = -(-n // length) if n else 0
        order = [torch.randperm(length, generator=g) for _ in range(repeats)]
        indices.append(torch.cat(order)[:n] if order else torch.zeros(0, dtype=torch.long))
        sources.append(torch.full((n,), i, dtype=torch.long))
    places = torch.randperm(size, generator=g)
    return torch.cat(sources)[places].numpy(), torch.cat(indices)[places].numpy()


class Mixture(Dataset):
    """Samples of `sources` in the order of a mixture_table; `consumed_counts` for the metrics."""

    def __init__(self, sources: dict[str, Any], weights: dict[str, float], size: int, seed: int) -> None:
        self.names = list(sources)
        self.sources = [sources[n] for n in self.names]
        self.source, self.index = mixture_table(
            [len(s) for s in self.sources], [weights[n] for n in self.names], size, seed
        )
        self._whole: dict[int, np.ndarray] = {}  # epoch -> samples per source in a whole epoch
        self._current: tuple[int, np.ndarray] = (-1, self.source[:0])  # an epoch's sources, read order

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> Any:
        return self.sources[int(self.source[i])][int(self.index[i])]

    def _bincount(self, sources: np.ndarray) -> np.ndarray:
        return np.bincount(sources, minlength=len(self.names))

    def counts(self, places: Any) -> dict[str, int]:
        """Samples of each source among the mixture's indices `places`."""
        hist = np.bincount(self.source[np.asarray(places, dtype=np.int64)], minlength=len(self.names))
        return {name: int(n) for name, n in zip(self.names, hist, strict=True)}

    def consumed_counts(
        self, sampler: Any, epoch: int, epoch_samples: int, per_epoch: int
    ) -> dict[str, float]:
        """`data/mix/<name>`: samples drawn from each source since step 0, over all ranks.

        Computed, not counted: the ranks together read a prefix of the sampler's global order
        each epoch (`per_epoch` samples in a whole one), so the numbers survive a resume and
        need no collective."""
        order = getattr(sampler, "global_order", None)
        if order is None:
            return {}
        totals = np.zeros(len(self.names), dtype=np.int64)
        for e in range(epoch):  # whole epochs: counted once, kept (a few numbers each)
            if e not in self._whole:
                self._whole[e] = self._bincount(self.source[np.asarray(order(e), dtype=np.int64)][:per_epoch])
            totals += self._whole[e]
        if self._current[0] != epoch:  # this epoch's sources in read order, until it ends
            self._current = (epoch, self.source[np.asarray(order(epoch), dtype=np.int64)])
        totals += self._bincount(self._current[1][:epoch_samples])
        return {f"data/mix/{name}": float(n) for name, n in zip(self.names, totals, strict=True)}


def load_mix(sources: Any, size: int | None = None, seed: int = 0) -> Mixture:
    """Build each source (`builtin: NAME` or `_target_`, minus its `weight`), then the mixture."""
    from omegaconf import DictConfig, OmegaConf

    specs = OmegaConf.to_container(sources, resolve=True) if isinstance(sources, DictConfig) else sources
    if not isinstance(specs, dict) or not specs:
        raise ConfigError(
            "data.mix",
            specs,
            "the sources by name, each with a weight and _target_ (or builtin)",
            "e.g. data.mix={a: {weight: 0.75, builtin: synthetic, num_samples: 3000}, "
            "b: {weight: 0.25, _target_: mylab.data.make_b}}.",
        )
    built: dict[str, Any] = {}
    weights: dict[str, float] = {}
    for name, spec in specs.items():
        weights[str(name)], built[str(name)] = _source(str(name), spec)
    if size is None:  # the most samples with no source repeated
        size = min(int(len(built[n]) * sum(weights.values()) / weights[n]) for n in built)
    if size < 1:
        raise ConfigError("data.size", size, "null or >= 1", "samples in one epoch of the mixture.")
    _same_structure(built)
    return Mixture(built, weights, size, seed)


def _source(name: str, spec: Any) -> tuple[float, Any]:
    from disttrain.config.instantiate import build

    key = f"data.mix.{name}"
    if not isinstance(spec, dict) or ("_target_" in spec) == ("builtin" in spec):
        raise ConfigError(
            key,
            spec,
            f"a data set spec with weight and either _target_ or builtin ({', '.join(BUILTINS)})",
            f"e.g. {key}={{weight: 0.5, builtin: synthetic}} or "
            f"{key}={{weight: 0.5, _target_: mylab.data.make}}.",
        )
    spec = dict(spec)
    weight = spec.pop("weight", None)
    if not isinstance(weight, int | float) or isinstance(weight, bool) or not weight > 0:
        raise ConfigError(f"{key}.weight", weight, "a number > 0", "the source's share, e.g. 0.25.")
    if "builtin" in spec:
        builtin = spec.pop("builtin")
        if builtin not in BUILTINS:
            raise ConfigError(f"{key}.builtin", builtin, ", ".join(BUILTINS), "or give _target_ instead.")
        spec = {"_target_": BUILTINS[builtin], "_recursive_": False, **spec}
    try:
        dataset = build(spec, key)
    except ConfigError as err:  # a built-in names its own keys (data.path): name the source's
        raise _under(err, key, spec) from None
    if not hasattr(dataset, "__len__") or len(dataset) == 0:
        raise ConfigError(
            key,
            spec.get("_target_"),
            "a map-style data set with at least one sample",
            "a stream cannot be mixed by index; check what the source builds.",
        )
    return float(weight), dataset


def _under(err: ConfigError, key: str, spec: dict[str, Any]) -> ConfigError:
    leaf = err.key.rpartition(".")[2]
    if err.key.startswith("data.") and not err.key.startswith("data.mix.") and leaf in spec:
        return ConfigError(f"{key}.{leaf}", err.value, err.allowed, err.hint)
    return err


def _same_structure(built: dict[str, Any]) -> None:
    """Every source's samples batch together: the same fields, shapes and dtypes."""
    shapes = {name: _shape(ds[0]) for name, ds in built.items()}
    first = next(iter(shapes))
    for name, shape in shapes.items():
        if shape != shapes[first]:
            raise ConfigError(
                f"data.mix.{name}",
                shape,
                f"samples shaped like data.mix.{first}'s: {shapes[first]}",
                "mixed samples are batched together: make every source yield the same fields "
                "with the same shapes and dtypes.",
            )


def _shape(sample: Any) -> Any:
    if isinstance(sample, torch.Tensor):
        return f"{tuple(sample.shape)} {sample.dtype}"
    if isinstance(sample, dict):
        return {k: _shape(v) for k, v in sample.items()}
    if isinstance(sample, list | tuple):
        return [_shape(v) for v in sample]
    return type(sample).__name__
