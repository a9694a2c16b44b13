"""disttrain.checkpoint in one process: atomic commit, `latest`, retention, corruption fallback,
weights_only loading, and the pieces of exact resume (RNG, sampler position, config fingerprint)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from disttrain import checkpoint
from disttrain.checkpoint import dcp_read as ckpt_dcp_read
from disttrain.checkpoint import files as ckpt_files
from disttrain.checkpoint import writing as ckpt_writing
from disttrain.config.fingerprint import config_diff, config_hash, shaping_config
from disttrain.data.samplers import ResumableSampler
from disttrain.rng import rng_state, set_rng_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(ckpt_dir: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, keep: int = 3) -> None:
    msd, osd = get_state_dict(model, opt)
    meta = {"step": step, "epoch": 0, "epoch_samples": 0, "samples": 0, "reason": "test"}
    checkpoint.save(
        ckpt_dir, step, {"model": msd, "optim": osd}, rng_state(), meta, rank=0, keep=keep, verify="hash"
    )


def _load_into(path: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = _trained(seed=99)  # different weights and optimizer state
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    checkpoint.load_sharded(path, state, rank=0, no_dist=True)
    model.load_state_dict(state["model"])
    return model, opt


def test_commit_writes_a_whole_folder_and_points_latest(tmp_path: Path) -> None:
    model, opt = _trained()
    _save(tmp_path, 5, model, opt)
    path = tmp_path / "step_00000005"
    assert checkpoint.read_latest(tmp_path) == "step_00000005"
    assert not list(tmp_path.glob(".tmp-*")), "the temporary folder was renamed into place"
    manifest = json.loads((path / "manifest.json").read_text())
    assert {".metadata", "meta.json", "rng_rank0.pt"} <= set(manifest["files"])
    assert all(set(f) == {"size", "xxh3_64"} and len(f["xxh3_64"]) == 16 for f in manifest["files"].values())
    assert checkpoint.problem(path) is None
    loaded, _ = _load_into(path)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True)
    )


def test_retention_keeps_the_newest_n(tmp_path: Path) -> None:
    model, opt = _trained()
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step, model, opt, keep=2)
    assert [p.name for p in checkpoint.committed(tmp_path)] == ["step_00000004", "step_00000005"]
    assert checkpoint.read_latest(tmp_path) == "step_00000005"


def test_truncated_file_falls_back_to_previous(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _trained()
    _save(tmp_path, 1, model, opt)
    _save(tmp_path, 2, model, opt)
    shard = next((tmp_path / "step_00000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    with caplog.at_level(logging.WARNING, logger="disttrain"):
        chosen = checkpoint.choose(tmp_path)
    assert chosen == tmp_path / "step_00000001"
    assert shard.name in caplog.text and "truncated" in caplog.text and "falling back" in caplog.text


def test_corrupted_bytes_same_size_are_caught_by_the_hash(tmp_path: Path) -> None:
    model, opt = _trained()
    _save(tmp_path, 1, model, opt)
    _save(tmp_path, 2, model, opt)
    shard = next((tmp_path / "step_00000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "wrong xxh3_64" in (checkpoint.problem(tmp_path / "step_00000002") or "")
    assert checkpoint.problem(tmp_path / "step_00000002", verify="size") is None  # size alone can't tell
    assert checkpoint.choose(tmp_path) == tmp_path / "step_00000001"


def test_uncommitted_folder_is_never_chosen(tmp_path: Path) -> None:
    model, opt = _trained()
    _save(tmp_path, 1, model, opt)
    (tmp_path / ".tmp-step_00000002").mkdir()  # a save a crash interrupted
    (tmp_path / "step_00000003").mkdir()  # a folder without a manifest
    assert checkpoint.choose(tmp_path) == tmp_path / "step_00000001"


SAVER = """
import sys, torch
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict
from pathlib import Path
from disttrain import checkpoint
from disttrain.rng import rng_state
ckpt = sys.argv[1]
model = nn.Linear(256, 256); opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in (1, 2):
    msd, osd = get_state_dict(model, opt)
    if step == 2:
        print("saving 2", flush=True)
    checkpoint.save(Path(ckpt), step, {"model": msd, "optim": osd}, rng_state(), {"step": step},
                    rank=0, keep=3, verify="hash")
    print("saved", step, flush=True)
    import os; os.environ["DISTTRAIN_TEST_SAVE_SLEEP"] = "60"
"""


def test_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    """SIGKILL while the second save is inside its write: step 1 stays complete and is chosen."""
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until the second save's shards are on disk
            if (ckpt / ".tmp-step_00000002" / ".metadata").exists():
                break
            time.sleep(0.05)
        else:
            pytest.fail("the second save never started")
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert "saved 2" not in out
    assert checkpoint.read_latest(ckpt) == "step_00000001"
    assert checkpoint.choose(ckpt) == ckpt / "step_00000001"
    state = {"model": nn.Linear(256, 256).state_dict()}
    checkpoint.load_sharded(ckpt / "step_00000001", state, rank=0, no_dist=True)


class _Evil:
    """Unpickling it creates the file `marker`: proof that a checkpoint ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def test_loading_never_runs_pickled_code(tmp_path: Path) -> None:
    model, opt = _trained()
    _save(tmp_path, 1, model, opt)
    path = tmp_path / "step_00000001"
    marker = tmp_path / "pwned"
    torch.save({"x": _Evil(marker)}, path / "rng_rank0.pt")
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.load(path / "rng_rank0.pt")
    (path / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    # read before dcp.load (no DCP traceback in the log, reliability 11-28 D21): the refusal itself
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        _load_into(path)
    assert not marker.exists(), "loading a checkpoint ran pickled code"


def _stack_global(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle calling `module`.`name`(arg) through STACK_GLOBAL (dotted names allowed)."""
    s = lambda x: b"\x8c" + bytes([len(x)]) + x.encode()  # noqa: E731  SHORT_BINUNICODE
    return b"\x80\x04" + s(module) + s(name) + b"\x93" + s(arg) + b"\x85R."


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("torch.distributed.checkpoint.metadata", "os.system"),  # review D1: dotted walk to os.system
        ("torch.distributed.checkpoint.metadata", "torch.load"),  # through the module's own imports
        ("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__"),
        ("torch.distributed.checkpoint.metadata", "os"),  # a module object, not a class
        ("torch.distributed.checkpoint.metadata", "field"),  # a function the module imported
        ("torch", "os.system"),  # the dtype shortcut must not getattr a dotted name
        ("torch", "load"),
        ("pathlib", "os.system"),
        ("collections", "OrderedDict.__reduce__"),
        ("builtins", "eval"),
    ],
)
def test_crafted_metadata_never_runs_code(tmp_path: Path, module: str, name: str) -> None:
    """Review D1: a `.metadata` re-hashed into the manifest that calls os.system on load."""
    model, opt = _trained()
    _save(tmp_path, 1, model, opt)
    path = tmp_path / "step_00000001"
    marker = tmp_path / "pwned"
    payload = _stack_global(module, name, f"touch {marker}")
    (path / ".metadata").write_bytes(payload)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoint.problem(path) is None  # the manifest is no defence: whoever edits it re-hashes
    with pytest.raises((CheckpointException, pickle.UnpicklingError), match="not allowed"):
        _load_into(path)
    assert not marker.exists(), f"loading a checkpoint ran {module}.{name}"


def test_metadata_unpickler_admits_exactly_a_fixed_list() -> None:
    """Enumerate every public and private name of every module the allow-list mentions (plus
    builtins, os, torch): what resolves must equal this fixed list, or a review must extend it."""
    expected = {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "Path"),
        ("collections", "OrderedDict"),
    }
    import importlib
    import io

    modules = {m for m, _ in expected} | {"builtins", "os", "pickle", "torch.distributed.checkpoint"}
    unpickler = ckpt_dcp_read._SafeUnpickler(io.BytesIO(b""))
    admitted = set()
    for module in sorted(modules):
        names = set(dir(importlib.import_module(module))) | {"os.system", "torch.load", "__builtins__"}
        for name in sorted(names):
            try:
                unpickler.find_class(module, name)
            except pickle.UnpicklingError:
                continue
            admitted.add((module, name))
    dtypes = {(m, n) for m, n in admitted if m == "torch" and isinstance(getattr(torch, n), torch.dtype)}
    assert admitted - dtypes == expected
    assert {"float32", "bfloat16", "int64"} <= {n for _, n in dtypes}
    assert all("." not in n and not n.startswith("__") for _, n in admitted)


def test_every_torch_load_in_the_package_is_weights_only() -> None:
    root = Path(checkpoint.__file__).parent.parent  # the whole disttrain package
    for source in root.rglob("*.py"):
        for call in re.findall(r"torch\.load\([^)]*\)", source.read_text()):
            assert "weights_only=True" in call, f"{source}: {call}"


def test_export_writes_a_plain_state_dict(tmp_path: Path) -> None:
    model, opt = _trained()
    _save(tmp_path, 1, model, opt)
    target = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    for name in ("model.pt", "model.safetensors"):
        checkpoint.export_model(tmp_path, tmp_path / name, target)
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    from safetensors.torch import load_file

    plain.load_state_dict(load_file(str(tmp_path / "model.safetensors")))
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True)
    )


def test_rng_state_round_trip_through_a_weights_only_file(tmp_path: Path) -> None:
    import random

    import numpy as np

    state = rng_state()
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    torch.save(state, tmp_path / "rng.pt")
    set_rng_state(checkpoint.load(tmp_path / "rng.pt"))
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


@pytest.mark.parametrize("world", [1, 2])
def test_sampler_resumes_by_index(world: int) -> None:
    data = list(range(100))
    for rank in range(world):
        full = ResumableSampler(data, num_replicas=world, rank=rank, seed=3, drop_last=True)  # type: ignore[arg-type]
        full.set_epoch(2)
        part = ResumableSampler(data, num_replicas=world, rank=rank, seed=3, drop_last=True)  # type: ignore[arg-type]
        part.set_epoch(2)
        part.set_start(7)
        assert list(part) == list(full)[7:] and len(part) == len(full) - 7


def test_world_size_change_continues_the_same_permutation() -> None:
    """2 ranks consumed 40 samples; 1 rank continues exactly at global sample 40."""
    data = list(range(100))
    two = [ResumableSampler(data, num_replicas=2, rank=r, seed=3, drop_last=True) for r in range(2)]  # type: ignore[arg-type]
    order = [
        i for pair in zip(*(list(s) for s in two), strict=True) for i in pair
    ]  # global order, interleaved
    one = ResumableSampler(data, num_replicas=1, rank=0, seed=3, drop_last=True)  # type: ignore[arg-type]
    one.set_start(40)
    assert list(one)[:20] == order[40:60]


def test_config_hash_ignores_logging_and_names_changed_keys() -> None:
    a = {
        "optim": {"lr": 0.1},
        "trainer": {"log_every": 1, "max_steps": 10},
        "name": "x",
        "checkpoint": {"keep": 1},
    }
    b = json.loads(json.dumps(a))
    b["trainer"]["log_every"], b["name"], b["checkpoint"]["keep"] = 5, "y", 3
    assert config_hash(a) == config_hash(b)
    b["optim"]["lr"] = 0.2
    assert config_hash(a) != config_hash(b)
    assert config_diff(shaping_config(a), shaping_config(b)) == ["optim.lr: 0.1 -> 0.2"]


def _gpt_run(tmp_path: Path) -> tuple[Path, dict[str, Any], nn.Module]:
    """A run dir as `disttrain train model=gpt` leaves it: config.yaml and one committed checkpoint."""
    import yaml
    from unit_support import checked

    from disttrain.models import build_model

    cfg = checked(["model=gpt", "model.dim=16", "model.n_layers=1"])
    assert cfg["model"]["tie_weights"] is True
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    torch.manual_seed(0)
    model = build_model(cfg["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    opt.step()
    _save(tmp_path / "checkpoints", 1, model, opt)
    return tmp_path, cfg, model


def test_export_of_a_tied_gpt_to_safetensors_loads_back_with_its_config(tmp_path: Path) -> None:
    """safetensors refused the shared embed.tok/head.out tensor (real-clients review §2)."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    from disttrain.commands.export import export
    from disttrain.models.gpt import GPT

    run_dir, cfg, trained = _gpt_run(tmp_path)
    out = tmp_path / "out" / "m.safetensors"
    assert export(run_dir, run_dir, out) == 0
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    model_cfg = json.loads(meta["disttrain.model"])
    assert model_cfg == cfg["model"] and model_cfg["_target_"] == "disttrain.models.gpt.GPT"
    fresh = GPT(**{k: v for k, v in model_cfg.items() if k != "_target_"})
    load_model(fresh, str(out))
    assert fresh.head.out.weight is fresh.embed.tok.weight, "still tied after loading"
    x = torch.randint(0, 256, (2, 8))
    trained.eval(), fresh.eval()
    assert torch.equal(trained(x), fresh(x))
    pt = tmp_path / "m.pt"  # the torch.save export stays a plain state dict
    export(run_dir, run_dir, pt)
    plain = GPT(**{k: v for k, v in model_cfg.items() if k != "_target_"})
    plain.load_state_dict(torch.load(pt, weights_only=True))
    assert torch.equal(trained(x), plain.eval()(x))


@pytest.mark.parametrize("where", ["a-folder", "under-a-file", "in-proc"])
def test_export_out_must_be_a_file_path_that_can_be_written(tmp_path: Path, where: str) -> None:
    """Review D24: `export --out /proc/x.pt` blamed RUN_DIR (root passes os.access on /proc)."""
    from disttrain.commands.export import cmd_export
    from disttrain.config import ConfigError

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("model: {}\n")
    (tmp_path / "a-file").write_text("")
    out = {"a-folder": tmp_path, "under-a-file": tmp_path / "a-file" / "m.pt", "in-proc": Path("/proc/x.pt")}[
        where
    ]
    with pytest.raises(ConfigError) as info:
        cmd_export([str(tmp_path / "run"), "--out", str(out)])
    assert (info.value.key, info.value.value) == ("--out", str(out))


def _rehash(path: Path) -> None:
    """Rewrite the manifest for the files as they are now: what someone editing a checkpoint does."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = {
        f.name: ckpt_files._file_digest(f, True) for f in path.iterdir() if f.name != "manifest.json"
    }
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("broken", ["rng_pickle", "metadata_garbage"])
def test_export_falls_back_past_a_checkpoint_that_passes_the_manifest_but_does_not_load(
    tmp_path: Path, broken: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Review B10/B11: a re-hashed manifest hides a bad pickle; the load error names it, step 1 is used."""
    model, opt = _trained()
    _save(tmp_path, 1, model, opt)
    _save(tmp_path, 2, *_trained(seed=5))
    bad = tmp_path / "step_00000002"
    marker = tmp_path / "pwned"
    if broken == "rng_pickle":
        torch.save({"x": _Evil(marker)}, bad / "rng_rank0.pt")
    else:
        (bad / ".metadata").write_bytes(bytes(range(100)))
    _rehash(bad)
    assert checkpoint.problem(bad) is None, "the manifest check alone cannot see it"
    target = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    with caplog.at_level(logging.WARNING, logger="disttrain"):
        used = checkpoint.export_model(tmp_path, tmp_path / "model.pt", target)
    assert used == tmp_path / "step_00000001"
    assert "step_00000002 is not loadable" in caplog.text and "falling back" in caplog.text
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())
    assert not marker.exists()


def test_resume_from_an_older_step_supersedes_the_abandoned_timeline(tmp_path: Path) -> None:
    """Review B25: after resuming at step 10, keep-N and the fallback see only the new timeline."""
    model, opt = _trained()
    for step in (10, 20, 30):
        _save(tmp_path, step, model, opt, keep=5)
    moved = checkpoint.supersede(tmp_path, 10)  # what the engine does after restoring step 10
    assert [p.name for p in moved] == ["step_00000020", "step_00000030"]
    for step in (12, 14, 16):
        _save(tmp_path, step, model, opt, keep=2)
    assert [p.name for p in checkpoint.committed(tmp_path)] == ["step_00000014", "step_00000016"]
    assert sorted(p.name for p in (tmp_path / "superseded").iterdir()) == ["step_00000020", "step_00000030"]
    shard = next((tmp_path / "step_00000016").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    assert checkpoint.choose(tmp_path) == tmp_path / "step_00000014"


def test_checksums_computed_while_writing_equal_each_files_checksum(tmp_path: Path) -> None:
    """The manifest's xxh3_64 comes from the bytes DCP wrote (no second read): it must equal a
    fresh xxh3_64 of every file on disk, for DCP's shards, .metadata, rng and meta.json alike."""
    model, opt = _trained()
    msd, osd = get_state_dict(model, opt)
    writer = ckpt_writing._writer(tmp_path / "w", with_hash=True)
    torch.distributed.checkpoint.save({"model": msd, "optim": osd}, storage_writer=writer, no_dist=True)
    on_disk = {f.name: ckpt_files._file_digest(f, True) for f in (tmp_path / "w").iterdir()}
    assert writer.fs.digests == on_disk and len(on_disk) == 1 + checkpoint.WRITER_THREADS
    _save(tmp_path / "ckpt", 1, model, opt)
    path = tmp_path / "ckpt" / "step_00000001"
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert manifest == {
        f.name: ckpt_files._file_digest(f, True) for f in path.iterdir() if f.name != "manifest.json"
    }


def test_a_write_through_the_hashing_file_never_follows_a_planted_symlink(tmp_path: Path) -> None:
    """Each shard file is planted as a symlink: the write fails (ELOOP), in DCP's caller thread and
    in its extra writer thread alike (whose exceptions DCP itself would only print)."""
    for i in range(checkpoint.WRITER_THREADS):
        (tmp_path / f"w{i}").mkdir()
        (tmp_path / f"victim{i}").write_text("keep")
        (tmp_path / f"w{i}" / f"__0_{i}.distcp").symlink_to(tmp_path / f"victim{i}")
        writer = ckpt_writing._writer(tmp_path / f"w{i}", with_hash=True)
        with pytest.raises((CheckpointException, OSError)):  # ELOOP, raised or wrapped by DCP
            torch.distributed.checkpoint.save({"x": torch.ones(3)}, storage_writer=writer, no_dist=True)
        assert (tmp_path / f"victim{i}").read_text() == "keep"


def test_commit_hashes_from_disk_a_file_whose_digest_is_missing_or_stale(tmp_path: Path) -> None:
    tmp = tmp_path / ".tmp-step_00000001"
    tmp.mkdir()
    for name in (".metadata", "a", "b", "c"):
        (tmp / name).write_bytes(name.encode() * 100)
    stale = {
        "a": {"size": 100, "xxh3_64": "0" * 16},
        "b": {"size": 7, "xxh3_64": "0" * 16},
        "c": {"size": 100, "crc32": "0" * 8},
    }
    checkpoint.commit_dir(tmp_path, tmp, "step_00000001", {"step": 1}, "hash", 3, stale)
    path = tmp_path / "step_00000001"
    files = json.loads((path / "manifest.json").read_text())["files"]
    assert files["a"]["xxh3_64"] == "0" * 16, "a digest of the right size is trusted (it came from the write)"
    assert files["b"] == ckpt_files._file_digest(path / "b", True), "a wrong size is re-hashed from disk"
    assert files["c"] == ckpt_files._file_digest(path / "c", True), "new manifests carry xxh3_64 only"
    assert files[".metadata"] == ckpt_files._file_digest(path / ".metadata", True)


def test_async_save_commits_in_the_background_and_reuses_its_staging_buffers(tmp_path: Path) -> None:
    """An async save returns once staged; later changes to the live state never reach the file,
    the commit (manifest, `latest`) happens without the caller, and the second save stages into
    the same CPU buffers as the first (no fresh allocation)."""
    model, opt = _trained()
    msd, osd = get_state_dict(model, opt)
    expected = {k: v.clone() for k, v in msd.items()}
    meta = {"step": 1, "epoch": 0, "epoch_samples": 0, "samples": 0, "reason": "test"}
    pending = checkpoint.save(
        tmp_path, 1, {"model": msd, "optim": osd}, rng_state(), meta, rank=0, keep=3, verify="hash",
        async_save=True,
    )  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on while the save is written
    deadline = time.monotonic() + 60
    while not pending.ready() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pending.ready() and checkpoint.read_latest(tmp_path) == "step_00000001", "committed unasked"
    pending.wait()
    assert checkpoint.problem(tmp_path / "step_00000001") is None
    loaded, _ = _load_into(tmp_path / "step_00000001")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.items())
    stager = ckpt_writing._Background.stager
    staged = {id(s) for s in stager._state_dict_stager._cached_storage_mapping.values()}
    second = checkpoint.save(
        tmp_path, 2, {"model": msd, "optim": osd}, rng_state(), dict(meta, step=2), rank=0, keep=3,
        verify="hash", async_save=True,
    )  # fmt: skip
    second.wait()
    assert {id(s) for s in stager._state_dict_stager._cached_storage_mapping.values()} == staged
    loaded, _ = _load_into(tmp_path / "step_00000002")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_load_verifying_hashes_fails_on_a_flipped_byte_and_names_the_file(tmp_path: Path) -> None:
    """verify=hash at load: xxh3_64 checked in the pass that reads each file; a same-size corruption raises (the
    engine's resume then falls back), and the untouched checkpoint loads."""
    model, opt = _trained()
    _save(tmp_path, 1, model, opt)
    _save(tmp_path, 2, model, opt)
    path = tmp_path / "step_00000002"
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert checkpoint.choose(tmp_path, "size") == path, "sizes alone cannot see it"
    state = {"model": get_state_dict(*_trained(seed=99))[0]}
    with pytest.raises(
        checkpoint.CorruptCheckpoint, match=f"{shard.name} has the right size but the wrong xxh3_64"
    ):
        checkpoint.load_sharded(path, state, rank=0, no_dist=True, verify="hash")
    assert checkpoint.load_errors()[0] is Exception  # the engine's resume catches it and falls back
    checkpoint.load_sharded(tmp_path / "step_00000001", state, rank=0, no_dist=True, verify="hash")
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
