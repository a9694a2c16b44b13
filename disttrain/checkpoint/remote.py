"""Checkpoints in an object store (checkpoint.dir=s3://... or gs://...), through fsspec and DCP's
FsspecWriter. The same guarantees as a local folder, by another means: an object store has no
rename and no folders, but each object appears whole (one PUT).

  s3://bucket/run/step_00000017/   .metadata, __R_0.distcp, rng_rankR.pt, meta.json, manifest.json
  s3://bucket/run/latest

A save writes straight under its final prefix; the checkpoint counts once rank 0 has written its
manifest (the commit marker, after every shard, rng file and meta.json) and then `latest`. A prefix
without a manifest (a save a kill interrupted) is never listed (`committed`), never loaded, never
counted by keep-N, and is removed by the next save. Pruning deletes the manifest first: a kill
mid-delete leaves an uncommitted prefix, never a half checkpoint that still looks whole.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Sequence
from typing import Any

from disttrain.checkpoint.files import _bytes_digest
from disttrain.checkpoint.layout import BEST, LATEST, MANIFEST, META, PREFIX, SUPERSEDED, step_name
from disttrain.storage import ObjectPath

log = logging.getLogger("disttrain")


def _steps(ckpt_dir: ObjectPath) -> dict[str, bool]:
    """{step_N: whether its manifest is there} of every step prefix, from one listing."""
    steps: dict[str, bool] = {}
    for key in ckpt_dir.listing():
        name, _, rest = key.partition("/")
        if name.startswith(PREFIX) and rest:
            steps[name] = steps.get(name, False) or rest == MANIFEST
    return steps


def committed(ckpt_dir: ObjectPath) -> list[ObjectPath]:
    """Committed checkpoints (a manifest under their prefix), oldest first."""
    return [ckpt_dir / name for name, whole in sorted(_steps(ckpt_dir).items()) if whole]


def prepare(ckpt_dir: ObjectPath, name: str) -> None:
    """Rank 0, before a save: remove what interrupted saves left, and the step's own prefix (the
    same step saved again, e.g. an emergency save after a periodic one: un-committed first)."""
    steps = _steps(ckpt_dir)
    for stale, whole in steps.items():
        if not whole:
            log.info("removing %s: a save that never committed", ckpt_dir / stale)
            (ckpt_dir / stale).rmtree()
    if steps.get(name):
        (ckpt_dir / name / MANIFEST).unlink()
        (ckpt_dir / name).rmtree()


def commit(
    ckpt_dir: ObjectPath,
    name: str,
    meta: dict[str, Any],
    verify: str,
    keep: int,
    digests: dict[str, dict[str, Any]],
    protect: Sequence[str] = (),
) -> ObjectPath:
    """meta.json, then manifest.json (the commit marker: every file it lists is whole in the store),
    then `latest` (and `best`), then keep-N. A file the writers did not digest (none, normally) or
    whose size in the store differs is read back and summed."""
    from disttrain.checkpoint.files import _file_digest
    from disttrain.checkpoint.reading import XXH3, algo_of

    with_hash = verify == "hash"
    target = ckpt_dir / name
    meta_bytes = json.dumps(meta, indent=1, sort_keys=True, default=str).encode()
    (target / META).write_bytes(meta_bytes)
    known = {**digests, META: _bytes_digest(meta_bytes, with_hash)}
    entries = {}
    for fname, size in target.files().items():
        if fname == MANIFEST:
            continue
        entry = known.get(fname)
        if entry is None or entry["size"] != size or algo_of(entry) != (XXH3 if with_hash else None):
            entry = _file_digest(target / fname, with_hash)  # type: ignore[arg-type]  # ObjectPath: stat, open
        entries[fname] = entry
    (target / MANIFEST).write_bytes(
        json.dumps({"files": entries, "name": name}, indent=1, sort_keys=True).encode()
    )
    (ckpt_dir / LATEST).write_text(name + "\n")
    if protect and protect[0] in {p.name for p in committed(ckpt_dir)}:
        (ckpt_dir / BEST).write_text(protect[0] + "\n")
    prune(ckpt_dir, keep, protect)
    return target


def read_pointer(ckpt_dir: ObjectPath, which: str) -> str | None:
    try:
        return (ckpt_dir / which).read_text().strip() or None
    except (OSError, FileNotFoundError):
        return None


def prune(ckpt_dir: ObjectPath, keep: int, protect: Collection[str] = ()) -> list[ObjectPath]:
    """All but the newest `keep` committed checkpoints (never `latest`'s, `best`'s nor `protect`'s):
    each un-committed (manifest deleted) before its objects go."""
    spared = {read_pointer(ckpt_dir, LATEST), read_pointer(ckpt_dir, BEST), *protect}
    doomed = [p for p in committed(ckpt_dir)[:-keep] if p.name not in spared]
    for p in doomed:
        (p / MANIFEST).unlink(missing_ok=True)
        p.rmtree()
    return doomed


def supersede(ckpt_dir: ObjectPath, step: int) -> list[ObjectPath]:
    """Committed checkpoints past `step` copied under `superseded/`, then removed (manifest first)."""
    moved = []
    for p in committed(ckpt_dir):
        if p.name > step_name(step):
            target = ckpt_dir / SUPERSEDED / p.name
            target.rmtree()
            p.fs.copy(p.key, target.key, recursive=True)
            (p / MANIFEST).unlink(missing_ok=True)
            p.rmtree()
            moved.append(target)
    names = {p.name for p in moved}
    for pointer in (LATEST, BEST):
        if read_pointer(ckpt_dir, pointer) in names:
            (ckpt_dir / pointer).unlink(missing_ok=True)
    return moved
