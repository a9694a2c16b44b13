"""Checkpoints: sharded (torch.distributed.checkpoint), committed atomically, verified at load.

Storage, one concern a module: `layout` (the folder's names, `latest`/`best`), `files` (plain files,
fsynced, and their digests), `writing` (DCP shards written, async staging), `commit` (the atomic rename,
the manifest written last), `retention` (what stays: prune, `superseded/`), `dcp_read` and `reading` (reading
shards safely, verified against the manifest), `fallback` (which checkpoint to load; its shards),
`export` (weights for plain PyTorch). `manager` decides what goes into one and when, given its state
objects explicitly; `init_from` loads weights only; `geometry` is the saved world's shape.

A save writes into `.tmp-<name>/`, fsyncs every file, then renames the folder into place and
replaces `latest`: a kill at any instant leaves the previous checkpoint whole. An async save copies
the state into staging buffers kept between saves and does all of that in a background thread. A
load checks the manifest (sizes up front; with verify=hash, every file's checksum in the same pass
that reads it into the live tensors: `reading`) and falls back to the previous good checkpoint,
naming the bad file. Nothing is ever unpickled freely: tensors and objects load with
weights_only=True, DCP's `.metadata` through an allow-list of DCP's own classes.

`from disttrain import checkpoint; checkpoint.save(...)`: the storage functions are re-exported here.
"""

from disttrain.checkpoint.commit import commit_dir
from disttrain.checkpoint.export import NoEMA, ema_entries, ema_names, export_model, load_model, write_model
from disttrain.checkpoint.fallback import (
    candidates,
    choose,
    dcp_metadata,
    load_errors,
    load_sharded,
    named,
    problem,
    pruned,
    read_meta,
    why_not,
)
from disttrain.checkpoint.files import fsync_dir, load, save_atomic
from disttrain.checkpoint.layout import (
    BEST,
    LATEST,
    MANIFEST,
    META,
    PREFIX,
    SUPERSEDED,
    TMP,
    point_best,
    point_latest,
    read_best,
    read_latest,
    step_name,
)
from disttrain.checkpoint.reading import CorruptCheckpoint
from disttrain.checkpoint.retention import committed, prune, supersede
from disttrain.checkpoint.writing import (
    WRITER_THREADS,
    PendingSave,
    remove_stale,
    save,
    stager_reusable,
    staging_options,
)

__all__ = [
    "BEST",
    "LATEST",
    "MANIFEST",
    "META",
    "PREFIX",
    "SUPERSEDED",
    "TMP",
    "WRITER_THREADS",
    "CorruptCheckpoint",
    "NoEMA",
    "PendingSave",
    "candidates",
    "choose",
    "commit_dir",
    "committed",
    "dcp_metadata",
    "ema_entries",
    "ema_names",
    "export_model",
    "fsync_dir",
    "load",
    "load_errors",
    "load_model",
    "load_sharded",
    "named",
    "point_best",
    "point_latest",
    "problem",
    "prune",
    "pruned",
    "read_best",
    "read_latest",
    "read_meta",
    "remove_stale",
    "save",
    "save_atomic",
    "stager_reusable",
    "staging_options",
    "step_name",
    "supersede",
    "why_not",
    "write_model",
]
