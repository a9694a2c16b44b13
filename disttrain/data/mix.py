"""`data=mix`: several data sets in one, each sample's source fixed by a table from the seed.

The table maps every index of the mixture to (source, index in the source): source i gets
round(size x weight_i) places (largest remainders, so the shares are exact), filled with
successive permutations of its samples (a small source repeats, a large one is cut), and the
places are shuffled together. The mixture is then a plain map-style data set: the loader's
ResumableSampler orders it, so a run resumes exactly as with any other map-style data, and the
same seed and weights give the same mixture at any world size.

The table is never materialised: every permutation is a keyed bijection (a Feistel network over
splitmix64 rounds, cycle-walked into range), so place i's (source, index) is computed when it is
read, in O(number of sources) memory whatever `size` is. A table of 10^8-10^9 places held as
arrays cost ~60 bytes a place in every process (the parent's checks and each rank).
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

_U64 = np.uint64
CHUNK = 1 << 20  # places located at a time where a whole epoch is counted


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + _U64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def permute(i: np.ndarray, n: int, key: Any) -> np.ndarray:
    """A bijection of [0, n) chosen by `key` (an int, or one per element), applied to `i` (values in
    [0, n)): a 4-round balanced Feistel network on the smallest even number of bits that holds n,
    cycle-walked (a value that lands outside [0, n) is permuted again until it is inside: under 4
    walks on average, since the domain is under 4n)."""
    x = np.asarray(i, dtype=_U64).copy()
    if n <= 1:
        return x.astype(np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = _U64((1 << half) - 1)
    with np.errstate(over="ignore"):
        base = np.broadcast_to(np.asarray(key, dtype=np.int64).astype(_U64), x.shape) * _U64(4)
    keys = [_mix64(base + _U64(r)) for r in range(4)]
    todo = np.arange(len(x))
    while len(todo):
        v = x[todo]
        left, right = v >> _U64(half), v & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k[todo]) & mask)
        x[todo] = (left << _U64(half)) | right
        todo = todo[x[todo] >= _U64(n)]
    return x.astype(np.int64)


class MixtureTable:
    """(source, index) of any place of a mixture, computed on demand (see the module docstring)."""

    def __init__(self, lengths: list[int], weights: list[float], size: int, seed: int) -> None:
        total = float(sum(weights))
        exact = [size * (w / total) for w in weights]  # w / total first: no overflow at 1e308
        counts = [math.floor(e) for e in exact]
        by_remainder = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
        for i in by_remainder[: size - sum(counts)]:
            counts[i] += 1
        self.lengths, self.size, self.seed = list(lengths), size, seed
        self.counts = counts
        self.ends = np.cumsum(counts)  # source k holds the shuffled places [ends[k-1], ends[k])

    def locate(self, places: Any) -> tuple[np.ndarray, np.ndarray]:
        """(sources, indices) of the mixture's `places` (an int or an array of them)."""
        shuffled = permute(np.atleast_1d(np.asarray(places, dtype=np.int64)), self.size, self.seed)
        sources = np.searchsorted(self.ends, shuffled, side="right")
        starts = np.concatenate(([0], self.ends[:-1]))
        nth = shuffled - starts[sources]  # the place's rank among its source's places
        indices = np.empty_like(nth)
        for k in np.unique(sources):
            mine = sources == k
            rounds, within = np.divmod(nth[mine], self.lengths[k])
            # each pass over a source is a permutation of its own, keyed by (seed, source, pass)
            keys = (self.seed * 1_000_003 + int(k) * 10_007) % (1 << 40) * (1 << 20) + rounds + 1
            indices[mine] = permute(within, self.lengths[k], keys)
        return sources, indices

    def source_counts(self, places: Any) -> np.ndarray:
        """Places of each source among `places`, counted CHUNK at a time."""
        flat = np.asarray(places, dtype=np.int64).ravel()
        hist = np.zeros(len(self.lengths), dtype=np.int64)
        for at in range(0, len(flat), CHUNK):
            sources, _ = self.locate(flat[at : at + CHUNK])
            hist += np.bincount(sources, minlength=len(self.lengths))
        return hist


def mixture_table(
    lengths: list[int], weights: list[float], size: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(source, index) of each of the `size` places of the mixture, as arrays; a pure function of its
    inputs (the mixture itself computes them place by place: MixtureTable)."""
    return MixtureTable(lengths, weights, size, seed).locate(np.arange(size))


class Mixture(Dataset):
    """Samples of `sources` in the order of a mixture table; `consumed_counts` for the metrics."""

    def __init__(self, sources: dict[str, Any], weights: dict[str, float], size: int, seed: int) -> None:
        self.names = list(sources)
        self.sources = [sources[n] for n in self.names]
        self.table = MixtureTable(
            [len(s) for s in self.sources], [weights[n] for n in self.names], size, seed
        )
        self._whole: dict[int, np.ndarray] = {}  # epoch -> samples per source in a whole epoch
        self._order: tuple[int, np.ndarray] = (-1, np.zeros(0, dtype=np.int64))  # an epoch's global order
        self._current: tuple[int, int, np.ndarray] = (-1, 0, np.zeros(len(self.names), dtype=np.int64))

    def __len__(self) -> int:
        return self.table.size

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < len(self):
            raise IndexError(f"place {i} of a mixture of {len(self)}")
        source, index = self.table.locate(i)
        return self.sources[int(source[0])][int(index[0])]

    def counts(self, places: Any) -> dict[str, int]:
        """Samples of each source among the mixture's indices `places`."""
        hist = self.table.source_counts(list(places) if not isinstance(places, np.ndarray) else places)
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
                self._whole[e] = self.table.source_counts(np.asarray(order(e), dtype=np.int64)[:per_epoch])
            totals += self._whole[e]
        # this epoch: the counts up to the last position asked, extended as the epoch goes on
        seen_epoch, seen, hist = self._current
        if seen_epoch != epoch or epoch_samples < seen:
            seen_epoch, seen, hist = epoch, 0, np.zeros(len(self.names), dtype=np.int64)
        if epoch_samples > seen:
            if self._order[0] != epoch:  # 8 bytes a place, as the sampler's own order
                self._order = (epoch, np.asarray(order(epoch), dtype=np.int64))
            ahead = self._order[1][seen:epoch_samples]
            hist = hist + self.table.source_counts(ahead)
        self._current = (seen_epoch, epoch_samples, hist)
        totals += hist
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
    total = sum(weights.values())
    if not math.isfinite(total):
        raise ConfigError(
            "data.mix",
            weights,
            "weights whose sum is a finite number",
            "only their ratios matter: e.g. 3 and 1.",
        )
    if size is None:  # the most samples with no source repeated (a float min: a tiny share's is huge)
        size = int(min(len(built[n]) * (total / weights[n]) for n in built))
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
    if (
        not isinstance(weight, int | float)
        or isinstance(weight, bool)
        or not weight > 0
        or not math.isfinite(weight)
    ):
        raise ConfigError(f"{key}.weight", weight, "a finite number > 0", "the source's share, e.g. 0.25.")
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
