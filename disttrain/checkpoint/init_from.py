"""`init.path`: start a run from weights alone (the model's: optimizer, schedule and step start fresh).

Sources: a disttrain export or `checkpoints/final.pt` (`.safetensors`, `.pt`), a Hugging Face model
folder (`model.safetensors`, or shards named by `model.safetensors.index.json`), and a disttrain
checkpoint (`step_N/`, or a checkpoints/ or run dir: its newest whole one; only its `model.*`
entries are read).

The parent compares names and shapes with the meta model from headers alone (safetensors headers,
DCP's `.metadata`, a memory-mapped `.pt`): a strict mismatch is one paragraph before launch. The
ranks apply the weights after `strategy.setup_module`, into the wrapped model's own tensors: a
DCP checkpoint through `dcp.load` (its planner reads each rank's shards), a file through the slice
of each DTensor's local chunk (safetensors `get_slice`, an mmap'd tensor's view), so no rank reads
or holds the whole model when the model is sharded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disttrain import storage
from disttrain.config.errors import ConfigError
from disttrain.config.schema import InitConfig
from disttrain.storage import ObjectPath, is_url

log = logging.getLogger("disttrain")

INDEX = "model.safetensors.index.json"
PT_SUFFIXES = (".pt", ".pth", ".bin")
ALLOWED = (
    "a .safetensors or .pt file (disttrain export, checkpoints/final.pt), a Hugging Face model folder "
    "(model.safetensors or model-0000x-of-0000y.safetensors + model.safetensors.index.json), or a "
    "disttrain checkpoint (step_N/, or a checkpoints/ or run dir holding one)"
)
SHOWN = 5  # names per list in a report


@dataclass
class Source:
    kind: str  # "dcp", "safetensors" or "pt"
    path: Path | ObjectPath  # the checkpoint folder (in an object store too), or the file or folder named
    files: dict[str, Path] = field(default_factory=dict)  # safetensors: key -> the file holding it


@dataclass
class Match:
    """How the source's keys meet the model's (model key -> source key), and what does not."""

    pairs: dict[str, str]
    missing: list[str]
    unexpected: list[str]
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]]  # key, model shape, source shape

    def problems(self, unexpected: bool = True) -> bool:
        return bool(self.missing or self.mismatched or (unexpected and self.unexpected))


# ------------------------------------------------------------------------------------ sources
def resolve(path: str, skip: Collection[Any] = ()) -> Source:
    """What `init.path` names, or one paragraph saying why it is none of the known kinds (`skip`:
    checkpoints of a training run that were pruned while this one looked at them)."""
    if is_url(path):
        return _resolve_remote(path, skip)
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix == ".safetensors":
            return Source("safetensors", p, _keys_of_files(path, [p]))
        if p.suffix in PT_SUFFIXES:
            return Source("pt", p)
        raise ConfigError("init.path", path, ALLOWED, f"{p.name} is neither .safetensors nor .pt.")
    if p.is_dir():
        if (p / INDEX).is_file():
            return Source("safetensors", p, _index(path, p))
        if (p / "model.safetensors").is_file():
            return Source("safetensors", p, _keys_of_files(path, [p / "model.safetensors"]))
        chosen = next((c for c in _choose_all(p) if c not in skip), None)
        if chosen is not None:
            return Source("dcp", chosen)
        raise ConfigError(
            "init.path",
            path,
            ALLOWED,
            f"{p} holds no model.safetensors, no {INDEX} and no committed checkpoint"
            + (" (the source run pruned each one this run chose while it read it)" if skip else "")
            + ".",
        )
    if p.exists():  # a FIFO, a device: never opened (reading one blocks or never ends)
        raise ConfigError("init.path", path, ALLOWED, f"{p} is not a regular file or a folder.")
    raise ConfigError(
        "init.path", path, ALLOWED, f"{p} does not exist; give a path that does (absolute or from here)."
    )


def _resolve_remote(path: str, skip: Collection[Any]) -> Source:
    """An object-store init.path: a disttrain checkpoint there (step_N/, or a checkpoint.dir prefix),
    read by DCP's fsspec reader; a file there is not memory-mapped from a store (copy it here)."""
    p = ObjectPath(path)
    chosen = next((c for c in _choose_all(p) if c not in skip), None)
    if chosen is not None:
        return Source("dcp", chosen)
    if p.name.endswith((".safetensors", *PT_SUFFIXES)) or (p / INDEX).exists():
        raise _bad(
            path,
            "a weights file in an object store is not read in place (only checkpoints are).",
            "Copy it to a local path (aws s3 cp / gsutil cp) and give that path.",
        )
    raise _bad(
        path,
        f"{p} holds no committed checkpoint (a step_N/ prefix with its manifest.json)"
        + (" (the source run pruned each one this run chose while it read it)" if skip else "")
        + ".",
    )


def _choose_all(p: Path | ObjectPath) -> Iterator[Path | ObjectPath]:
    """The newest whole checkpoint at `p`, then (when the caller skips it) the next one."""
    from disttrain import checkpoint

    skip: list[Any] = []
    while (found := checkpoint.choose(p, verify="size", skip=skip)) is not None:
        yield found
        skip.append(found)


def _bad(path: str, why: str, hint: str = "") -> ConfigError:
    return ConfigError("init.path", path, ALLOWED, why + (f" {hint}" if hint else ""))


def _index(given: str, folder: Path) -> dict[str, Path]:
    """key -> shard of a sharded Hugging Face folder, checked: every shard a regular file of the
    folder itself (a name with a `/`, `..`, an absolute path, a FIFO or a device is refused
    unread), and the index and the shards' headers agree key by key."""
    from disttrain.checkpoint.reading import name_problem

    index = folder / INDEX
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _bad(given, f"{index} is unreadable ({type(exc).__name__}: {exc}).") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise _bad(
            given, f'{index}: "weight_map" is a {type(weight_map).__name__}, not an object of key: file.'
        )
    for name in sorted(set(weight_map.values())):
        if why := name_problem(name):
            raise _bad(
                given, f"{index} names shard {name[:200]!r}, which {why}.", "Shards sit beside the index."
            )
        _regular(given, folder / name, folder)
    files = {k: folder / f for k, f in weight_map.items()}
    held = _shard_keys(given, sorted(set(files.values())))
    wrong = sorted(k for k, f in files.items() if k not in held[f])
    omitted = sorted({k for keys in held.values() for k in keys} - set(files))
    if wrong or omitted:
        parts = []
        if wrong:
            shown = [f"{k} -> {files[k].name}" for k in wrong]
            parts.append(f"names a shard that does not hold the key ({len(wrong)}): {_names(shown)}")
        if omitted:
            parts.append(f"omits keys its shards hold ({len(omitted)}): {_names(omitted)}")
        raise _bad(given, f"{index} " + "; ".join(parts) + ".", "Write the index again (save_pretrained).")
    return files


def _regular(given: str, f: Path, folder: Path) -> None:
    """A shard must be a regular file in `folder` (a link only into the folder, or into the blobs
    of the Hugging Face cache snapshot it belongs to): never a FIFO or a device (a read blocks or
    never ends), never another model's file elsewhere on this machine."""
    import stat

    try:
        st = f.stat()
    except OSError:
        raise _bad(given, f"{f} is missing (the index names it).", "Copy the whole model folder.") from None
    if not stat.S_ISREG(st.st_mode):
        raise _bad(given, f"{f} is not a regular file; it is never opened.")
    if f.is_symlink():
        real, home = f.resolve(), folder.resolve()
        allowed = [home] + ([home.parent.parent / "blobs"] if home.parent.name == "snapshots" else [])
        if not any(real.is_relative_to(a) for a in allowed):
            raise _bad(given, f"{f} is a link to {real}, outside the model folder; it is never read.")


def _shard_keys(given: str, files: list[Path]) -> dict[Path, set[str]]:
    """The keys each safetensors file holds, from its header."""
    from safetensors import safe_open

    held: dict[Path, set[str]] = {}
    for f in files:
        with _readable(given, f), safe_open(str(f), framework="pt") as opened:
            held[f] = set(opened.keys())
    return held


def _keys_of_files(given: str, files: list[Path]) -> dict[str, Path]:
    return {k: f for f, keys in _shard_keys(given, files).items() for k in sorted(keys)}


@contextlib.contextmanager
def _readable(given: str, f: Path) -> Iterator[None]:
    """A malformed safetensors file (a header too large, not JSON, offsets past the file's end)
    as one init.path paragraph naming it."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError) as exc:
        raise _bad(
            given,
            f"{f} is not a readable safetensors file ({str(exc).splitlines()[0][:300]}).",
            "Write it again with safetensors' save_file (or save_pretrained).",
        ) from None


def _pt_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A .pt's tensors, memory-mapped (nothing read until used); final.pt keeps them under "model".
    A mapped record is read as stored: a deflated one (torch.save never writes them) would become
    its compressed bytes as weights, so such a file is refused (review 2026-11-28-reliability D5)."""
    from disttrain.checkpoint.reading import CorruptCheckpoint, refuse_compressed

    try:
        refuse_compressed(path, str(path))
    except CorruptCheckpoint as exc:
        raise ConfigError(
            "init.path",
            str(path),
            ALLOWED,
            f"{exc}. Load it with torch.load and save it again with torch.save, or give another file.",
        ) from None
    obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    if not isinstance(obj, dict):
        raise ConfigError(
            "init.path", str(path), ALLOWED, f"{path} holds a {type(obj).__name__}, not a state dict."
        )
    return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}


def source_shapes(src: Source) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in the source, from headers (no tensor data is read)."""
    return {k: shape for k, (shape, _) in source_layout(src).items()}


def source_layout(src: Source) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor's name, shape and kind of dtype (`kind`) in the source, from headers; a source
    that cannot be read (a pickle asking for code, a legacy .pt, a malformed header) is one
    init.path paragraph. A checkpoint pruned meanwhile raises `Pruned`."""
    given = str(src.path)
    if src.kind == "dcp":
        return _dcp_layout(src)
    if src.kind == "pt":
        assert isinstance(src.path, Path)  # a file source is local (`resolve`)
        try:
            tensors = _pt_tensors(src.path)
        except ConfigError:
            raise
        except (pickle.UnpicklingError, RuntimeError, ValueError, OSError, EOFError) as exc:
            raise _bad(
                given, f"{src.path} cannot be read as a state dict: {_torch_reason(exc)}.", PT_HINT
            ) from None
        return {k: (tuple(v.shape), kind(v.dtype)) for k, v in tensors.items()}
    from safetensors import safe_open

    layout: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in sorted(set(src.files.values())):
        with _readable(given, f), safe_open(str(f), framework="pt") as opened:
            for k in opened.keys():  # noqa: SIM118 (safe_open is not iterable)
                if src.files.get(k) == f:
                    sl = opened.get_slice(k)
                    layout[k] = (tuple(sl.get_shape()), _SAFETENSORS_KINDS.get(sl.get_dtype(), "float"))
    return layout


class Pruned(FileNotFoundError):
    """The checkpoint chosen in a run that is still training was pruned while it was read."""


def _dcp_layout(src: Source) -> dict[str, tuple[tuple[int, ...], str]]:
    from disttrain import checkpoint

    try:
        entries = checkpoint.dcp_metadata(src.path).state_dict_metadata
    except FileNotFoundError:
        if not (src.path / ".metadata").exists():
            raise Pruned(str(src.path)) from None
        raise
    except checkpoint.CorruptCheckpoint as exc:  # storage paths outside the folder, a FIFO
        raise _bad(str(src.path), f"{exc}; nothing of it was read.") from None
    except (pickle.UnpicklingError, ValueError, EOFError, AttributeError, TypeError) as exc:
        raise _bad(
            str(src.path),
            f"{src.path / '.metadata'} is not DCP checkpoint metadata ({type(exc).__name__}: {str(exc)[:300]}); "
            "nothing in it was run.",
        ) from None
    return {
        k.removeprefix("model."): (tuple(v.size), kind(v.properties.dtype))
        for k, v in entries.items()
        if k.startswith("model.") and hasattr(v, "size")
    }


PT_HINT = (
    "A .pt for init.path is a state dict of tensors written by torch.save (torch >= 1.6: the zip "
    "format); load it in Python and save it again, or export it with safetensors' save_file."
)


def _torch_reason(exc: BaseException) -> str:
    """torch.load's refusal without its advice to turn weights_only off (that would run the file's
    code): the line that says what the file asked for."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    kept = [
        ln for ln in lines if "weights_only" not in ln.lower().replace(" ", "_") and "documentation" not in ln
    ]
    if isinstance(exc, RuntimeError) and "mmap can only be used" in str(exc):
        return "it is in torch.save's legacy (non-zip) format"
    if isinstance(exc, pickle.UnpicklingError):
        return f"its pickle is not plain tensors ({(kept or ['refused'])[0][:300]}); nothing in it was run"
    return f"{type(exc).__name__}: {(kept or [type(exc).__name__])[0][:300]}"


_SAFETENSORS_KINDS = {"BOOL": "bool", "C64": "complex", "C128": "complex"} | {
    f"{p}{n}": "int" for p in ("I", "U") for n in (8, 16, 32, 64)
}


def kind(dtype: torch.dtype) -> str:
    """A dtype's kind: bool, int, float or complex (a cast between kinds changes the values)."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "int"


def dtype_problems(
    m: Match, kinds: dict[str, str], source: dict[str, tuple[tuple[int, ...], str]]
) -> list[str]:
    """Pairs whose source tensor is of another kind than the model's (an int32 or bool tensor
    under a float parameter): `copy_` would cast it without a word. Float to float (f64, bf16)
    is a plain cast and fine."""
    return [
        f"{mkey} model {kinds[mkey]} vs source {source[skey][1]}"
        for mkey, skey in m.pairs.items()
        if kinds[mkey] != source[skey][1]
    ]


# ------------------------------------------------------------------------------------ matching
def rename(key: str, cfg: InitConfig) -> str:
    """A source key as the model names it: `init.prefix` stripped (or, as `+P`, added), then `init.map`."""
    if cfg.prefix.startswith("+"):
        key = cfg.prefix[1:] + key
    elif cfg.prefix:
        key = key.removeprefix(cfg.prefix)
    for old, new in cfg.map.items():
        if key == old:
            return new
        if old.endswith(".") and key.startswith(old):
            return new + key[len(old) :]
    return key


def model_layout(
    model: nn.Module, name: Callable[[str], str] = str
) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """The state dict's names (as `name` gives them) and (global) shapes, and which names share one
    tensor (tied weights)."""
    state = {name(k): v for k, v in model.state_dict(keep_vars=True).items()}
    return {k: tuple(v.shape) for k, v in state.items()}, {k: id(v) for k, v in state.items()}


def match(
    cfg: InitConfig,
    shapes: dict[str, tuple[int, ...]],
    ties: dict[str, int],
    source: dict[str, tuple[int, ...]],
) -> Match:
    """Pair model keys with source keys. A key tied to one that is loaded is not missing (a tied
    head is stored once: `save_model`, `save_pretrained`)."""
    by_model: dict[str, str] = {}
    for skey in source:
        by_model.setdefault(rename(skey, cfg), skey)
    pairs: dict[str, str] = {}
    mismatched = []
    for mkey, shape in shapes.items():
        if (found := by_model.get(mkey)) is None:
            continue
        if tuple(source[found]) != shape:
            mismatched.append((mkey, shape, tuple(source[found])))
        else:
            pairs[mkey] = found
    loaded = {ties[k] for k in pairs}
    missing = [k for k in shapes if k not in by_model and ties[k] not in loaded]
    unexpected = [s for s in source if rename(s, cfg) not in shapes]
    return Match(pairs, missing, unexpected, mismatched)


def _names(keys: list[str]) -> str:
    more = f", ... ({len(keys) - SHOWN} more)" if len(keys) > SHOWN else ""
    return ", ".join(keys[:SHOWN]) + more


def report(m: Match, src: Source, total: int, unexpected: bool = True) -> str:
    """One paragraph: what loads, and each kind of mismatch with a few names."""
    parts = [f"{len(m.pairs)} of {total} model tensors from {src.kind} {src.path}"]
    if m.missing:
        parts.append(f"missing in the source ({len(m.missing)}): {_names(m.missing)}")
    if unexpected and m.unexpected:
        parts.append(f"unexpected, no model key takes them ({len(m.unexpected)}): {_names(m.unexpected)}")
    if m.mismatched:
        shown = [f"{k} model {list(a)} vs source {list(b)}" for k, a, b in m.mismatched]
        parts.append(f"shape mismatch ({len(m.mismatched)}): {_names(shown)}")
    return "; ".join(parts)


def _fail(cfg: InitConfig, text: str) -> ConfigError:
    return ConfigError(
        "init.path",
        cfg.path,
        "weights whose keys and shapes match the model's" + (" (init.strict=true)" if cfg.strict else ""),
        f"{text}. Rename with init.prefix=PREFIX (stripped; '+PREFIX' adds) or "
        "'init.map={source_key: model_key}', or set init.strict=false to load what matches.",
    )


# ------------------------------------------------------------------------------------ parent
def check(init: InitConfig, model: nn.Module | None) -> None:
    """Before launch, on the meta model: the source (`init`: the run's `init` block) exists, is a
    known kind, and (strict) its keys and shapes are the model's. Reads headers only. `model` None
    (its structure is not knowable without weights): the kind only; the ranks compare the keys."""
    if not init.path:
        return
    src, layout = read_source(init.path)
    if model is None:
        log.info("init.path: %s %s; its keys are compared with the model's in the ranks", src.kind, src.path)
        return
    shapes, ties = model_layout(model)
    m = match(init, shapes, ties, {k: shape for k, (shape, _) in layout.items()})
    text = report(m, src, len(shapes))
    if not m.pairs or (init.strict and m.problems()):
        raise _fail(init, text)
    _refuse_casts(init, m, model_kinds(model), layout)
    if m.problems():
        log.warning("init.path (init.strict=false): %s", text)


def read_source(path: str) -> tuple[Source, dict[str, tuple[tuple[int, ...], str]]]:
    """`resolve` and `source_layout`; a checkpoint of a run that is still training, pruned between
    the choice and the read, is passed over for the next newest with one line."""
    pruned: list[Any] = []
    while True:
        src = resolve(path, pruned)
        try:
            return src, source_layout(src)
        except Pruned:
            log.info(
                "init.path: %s was pruned meanwhile (its run is training); taking the next newest",
                src.path.name,
            )
            pruned.append(src.path)


def model_kinds(model: nn.Module, name: Callable[[str], str] = str) -> dict[str, str]:
    return {name(k): kind(v.dtype) for k, v in model.state_dict(keep_vars=True).items()}


def _refuse_casts(
    init: InitConfig, m: Match, kinds: dict[str, str], layout: dict[str, tuple[tuple[int, ...], str]]
) -> None:
    if bad := dtype_problems(m, kinds, layout):
        raise ConfigError(
            "init.path",
            init.path,
            "source tensors of the model's kind of dtype (float for float: f64 or bf16 is cast; int or "
            "bool under a float parameter is not)",
            f"dtype mismatch ({len(bad)}): {_names(bad)}. Copying would cast the numbers without a word; "
            "convert the source's tensors (e.g. .float() where they are the weights, scaled as they should be).",
        )


# ------------------------------------------------------------------------------------ ranks
def build(init: InitConfig, build_model: Callable[[], nn.Module], meta_setup: bool) -> tuple[nn.Module, bool]:
    """The rank's model, and whether it is on the meta device (the caller then `to_empty`s it after
    `setup_module` and `apply` fills every tensor).

    Meta only when that is safe: init.path set with init.strict (every tensor is loaded, else the
    run fails), a strategy whose setup keeps a meta model on meta (`StrategySpec.meta_setup`), a
    factory that builds on meta, and a model with neither non-persistent buffers (rotary tables,
    masks: not in any file, and `to_empty` leaves them garbage) nor tied parameters (a plain
    `to_empty` unties them). Otherwise the factory builds the model as usual; the log says which.
    """
    if not (init.path and init.strict and meta_setup):
        return build_model(), False
    why = ""
    try:
        with torch.device("meta"):
            model = build_model()
    except Exception as exc:  # from_pretrained refuses the meta device
        why = f"its factory refuses the meta device ({type(exc).__name__})"
    else:
        tensors = [*model.parameters(), *model.buffers()]
        volatile = [
            f"{name}.{b}" if name else b
            for name, m in model.named_modules()
            for b in m._non_persistent_buffers_set
        ]
        tied = len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters()))
        if tensors and not all(t.is_meta for t in tensors):
            why = "its factory loads its own weights"
        elif volatile:
            why = f"non-persistent buffers ({_names(volatile)}) hold values no file has"
        elif tied:
            why = "it ties parameters (to_empty would untie them)"
        else:
            log.info(
                "init.path: the model is built on the meta device; each rank materialises its shards only"
            )
            return model, True
    log.info("init.path: the model is built on the CPU, then sharded: %s", why)
    return build_model(), False


def apply(init: InitConfig, model: nn.Module, is_zero: bool, name: Callable[[str], str] = str) -> None:
    """Load the source (`init`: the run's `init` block) into `model` (the plain or sharded module, after setup_module) in place;
    `name` maps its state dict's keys to the single-process model's (`Strategy.model_key`).

    Every rank calls it (a DCP source plans collectively). Keys another pipeline stage holds are
    not this rank's: strictness here covers missing keys and shapes; unexpected ones were checked
    on the whole meta model before launch."""
    if not init.path:
        return
    src, layout = read_source(init.path)
    if src.kind == "dcp" and dist.is_initialized() and dist.get_world_size() > 1:
        box = [str(src.path)]  # every rank loads rank 0's choice (a training source prunes as it goes)
        dist.broadcast_object_list(box, src=0)
        if box[0] != str(src.path):
            src = Source("dcp", storage.location(box[0]))
            layout = source_layout(src)
    state = {name(k): v for k, v in model.state_dict().items()}
    shapes, ties = model_layout(model, name)
    m = match(init, shapes, ties, {k: shape for k, (shape, _) in layout.items()})
    if not m.pairs or (init.strict and m.problems(unexpected=False)):
        raise _fail(init, report(m, src, len(shapes), unexpected=False))
    _refuse_casts(init, m, model_kinds(model, name), layout)
    with torch.no_grad():
        if src.kind == "dcp":
            _load_dcp(src.path, {skey: state[mkey] for mkey, skey in m.pairs.items()})
        else:
            with _slices(src) as read:
                for mkey, skey in m.pairs.items():
                    copy_own_slice(state[mkey], skey, read)
    if is_zero:
        sharded = any(_is_dtensor(t) for t in state.values())
        how = "each rank read only its own shards"  # build() said where the model was built
        log.info(
            "init.path: %s (%s)",
            report(m, src, len(shapes), unexpected=False),  # the whole model's were logged before launch
            how if sharded else "each rank read the whole tensors it holds",
        )


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


Reader = Callable[[str, tuple[slice, ...]], torch.Tensor]


def copy_own_slice(target: torch.Tensor, key: str, read: Reader) -> None:
    """Copy this rank's part of source tensor `key` into `target`: a DTensor's local chunk (its
    global offsets: DCP's own chunk list), else the whole tensor."""
    if _is_dtensor(target):
        local = target.to_local()  # type: ignore[attr-defined]
        chunks = target.__create_chunk_list__()  # type: ignore[attr-defined]
        if local.numel() == 0 or not chunks:
            return
        chunk = chunks[0]
        local.copy_(
            read(key, tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True)))
        )
    else:
        target.copy_(read(key, tuple(slice(None) for _ in target.shape)))


@contextlib.contextmanager
def _slices(src: Source) -> Iterator[Reader]:
    """`read(key, slices)`: only those elements are read from the file (safetensors get_slice, or
    an mmap'd tensor's view)."""
    if src.kind == "pt":
        assert isinstance(src.path, Path)  # a file source is local (`resolve`)
        tensors = _pt_tensors(src.path)
        yield lambda key, s: tensors[key][s] if s else tensors[key]
        return
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        opened = {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in set(src.files.values())}

        def read(key: str, s: tuple[slice, ...]) -> torch.Tensor:
            f = opened[src.files[key]]
            return f.get_slice(key)[s] if s else f.get_tensor(key)

        yield read


def _load_dcp(path: Path | ObjectPath, model_state: dict[str, torch.Tensor]) -> None:
    """`dcp.load` of the checkpoint's `model.*` entries named in `model_state` (source names), in
    place: its planner gives each rank the chunks its DTensors hold, resharding as needed."""
    from disttrain import checkpoint

    rank = dist.get_rank() if dist.is_initialized() else 0
    checkpoint.load_sharded(path, {"model": model_state}, rank, no_dist=not dist.is_initialized())
