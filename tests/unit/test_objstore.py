"""Checkpoints, weights and token data in an object store (s3://), on a real S3 server (moto's
server mode on 127.0.0.1, the `s3_bucket` fixture): saves commit by their manifest, keep-N prunes,
a corrupt or interrupted save falls back, tokens are read in ranges, init.path reads a checkpoint."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from disttrain import checkpoint
from disttrain.config.errors import ConfigError
from disttrain.rng import rng_state
from disttrain.storage import ObjectPath, probe, url_problem

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def _save(where: ObjectPath, step: int, seed: int, keep: int = 2, async_save: bool = False) -> nn.Module:
    model, opt = _model(seed)
    msd, osd = get_state_dict(model, opt)
    meta = {"step": step, "epoch": 0, "epoch_samples": 0, "samples": 0, "reason": "test"}
    checkpoint.save(
        where,
        step,
        {"model": msd, "optim": osd},
        rng_state(),
        meta,
        rank=0,
        keep=keep,
        verify="hash",
        async_save=async_save,
    ).wait()
    return model


def _loaded(path: ObjectPath) -> nn.Module:
    model, opt = _model(99)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    checkpoint.load_sharded(path, state, rank=0, no_dist=True, verify="hash")
    model.load_state_dict(state["model"])
    return model


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_saves_commit_prune_verify_and_load_bitwise(s3_bucket: str) -> None:
    where = ObjectPath(f"{s3_bucket}/run")
    saved = {step: _save(where, step, seed=step, async_save=step == 3) for step in (1, 2, 3)}
    assert [p.name for p in checkpoint.committed(where)] == ["step_00000002", "step_00000003"]  # keep=2
    assert not (where / "step_00000001").exists(), "pruned: no object of it is left"
    assert checkpoint.read_latest(where) == "step_00000003"
    manifest = json.loads((where / "step_00000003" / "manifest.json").read_text())
    assert {".metadata", "meta.json", "rng_rank0.pt"} <= set(manifest["files"])
    assert all(len(e["xxh3_64"]) == 16 for e in manifest["files"].values())
    newest = checkpoint.choose(where, "hash")
    assert newest == where / "step_00000003" and _same(_loaded(newest), saved[3])
    # a shard overwritten with other bytes of the same size: the hash check falls back to step 2
    shard = newest / next(f for f in newest.files() if f.endswith(".distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert checkpoint.choose(where, "hash") == where / "step_00000002"
    with pytest.raises(checkpoint.CorruptCheckpoint, match="wrong xxh3_64"):
        _loaded(newest)


def test_a_save_killed_before_its_manifest_leaves_the_previous_one_loadable(s3_bucket: str) -> None:
    """Every process killed during a save: its objects are there, its manifest and `latest` are not.
    The previous checkpoint loads; keep-N does not count the partial one; the next save removes it."""
    where = ObjectPath(f"{s3_bucket}/run")
    kept = _save(where, 4, seed=4, keep=1)
    partial = where / "step_00000005"
    for f in (where / "step_00000004").files():  # the shards and meta of a save, not its marker
        if f != "manifest.json":
            (partial / f).write_bytes((where / "step_00000004" / f).read_bytes())
    assert [p.name for p in checkpoint.committed(where)] == ["step_00000004"]
    chosen = checkpoint.choose(where, "hash")
    assert chosen == where / "step_00000004" and _same(_loaded(chosen), kept)
    assert checkpoint.choose(partial, "size", fallback=False) is None
    _save(where, 6, seed=6, keep=1)  # the next save removes what the interrupted one left
    assert [p.name for p in where.iterdir() if p.name.startswith("step_")] == ["step_00000006"]
    # a resume from step 4 abandons step 6: kept under superseded/, out of keep-N and `latest`
    assert checkpoint.supersede(where, 4) == [where / "superseded" / "step_00000006"]
    assert checkpoint.committed(where) == [] and checkpoint.read_latest(where) is None
    assert checkpoint.problem(where / "superseded" / "step_00000006") is None


def test_tokens_from_s3_read_ranges_flat_in_object_size(s3_bucket: str) -> None:
    """data=tokens from s3://: the windows the local file gives, read in ranges: the bytes fetched and
    the peak memory of reading 16 windows do not grow with the object (0.5 MB, then 8 MB)."""
    from disttrain.data.tokens import RANGE, load_tokens

    costs = []
    for n_tokens in (1 << 18, 1 << 22):
        tokens = (np.arange(n_tokens) * 7 % 50_000).astype(np.uint16)
        url = f"{s3_bucket}/tok/{n_tokens}.bin"
        ObjectPath(url).write_bytes(tokens.tobytes())
        data = load_tokens(url, block_size=32, dtype="uint16", sampling="random", seed=1)
        tracemalloc.start()
        for i in range(16):
            x, y = data[i]
            start = data.offset(i)[1]
            assert torch.equal(x, torch.from_numpy(tokens[start : start + 32].astype(np.int64)))
            assert torch.equal(y, torch.from_numpy(tokens[start + 1 : start + 33].astype(np.int64)))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        costs.append((data._map(url).cache.total_requested_bytes, peak))
    (small_bytes, small_peak), (big_bytes, big_peak) = costs
    assert small_bytes <= 16 * (RANGE + 66) and big_bytes <= 16 * (RANGE + 66), costs  # a range a window
    assert big_peak < small_peak + 2 * RANGE, costs  # flat: the 8 MB object is never held whole


def test_gs_checkpoints_commit_prune_verify_load_and_tokens_read_in_ranges(gs_bucket: str) -> None:
    """gs:// through gcsfs on a GCS JSON API server on 127.0.0.1 (the `gs_bucket` fixture): the same
    saves (one async), keep-N, hash verification, bitwise load, token windows in ranged reads and
    the pre-launch probe as on S3."""
    from disttrain.data.tokens import RANGE, load_tokens

    where = ObjectPath(f"{gs_bucket}/run")
    probe("checkpoint.dir", where.url, write=True)
    saved = {step: _save(where, step, seed=step, keep=1, async_save=step == 2) for step in (1, 2)}
    assert [p.name for p in checkpoint.committed(where)] == ["step_00000002"]
    assert checkpoint.read_latest(where) == "step_00000002" and not (where / "step_00000001").exists()
    newest = checkpoint.choose(where, "hash")
    assert newest == where / "step_00000002" and _same(_loaded(newest), saved[2])
    tokens = (np.arange(1 << 20) * 7 % 50_000).astype(np.uint16)
    url = f"{gs_bucket}/tok/train.bin"
    ObjectPath(url).write_bytes(tokens.tobytes())
    data = load_tokens(url, block_size=32, dtype="uint16", sampling="random", seed=1)
    for i in range(8):
        start = data.offset(i)[1]
        assert torch.equal(data[i][0], torch.from_numpy(tokens[start : start + 32].astype(np.int64)))
    assert data._map(url).cache.total_requested_bytes <= 8 * (RANGE + 66), "a range a window, not 2 MiB"
    with pytest.raises(ConfigError, match="does not exist at this endpoint"):
        probe("checkpoint.dir", "gs://no-such-bucket-here/run")


def test_init_path_from_s3_starts_from_those_weights(s3_bucket: str) -> None:
    from disttrain.checkpoint import init_from
    from disttrain.config.schema import InitConfig

    where = f"{s3_bucket}/src"
    trained = _save(ObjectPath(where), 7, seed=7)
    fresh, _ = _model(123)
    init = InitConfig(path=where)
    init_from.check(init, fresh)
    init_from.apply(init, fresh, is_zero=True)
    assert _same(fresh, trained)


def test_bad_urls_are_one_paragraph_before_launch(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import s3fs

    assert url_problem("s3://bkt/a/../b") and url_problem("s3://B!/x") and url_problem("ftp://h/x")
    probe("checkpoint.dir", f"{s3_bucket}/run", write=True)  # reachable, exists, writable: no error
    with pytest.raises(ConfigError, match="does not exist at this endpoint"):
        probe("checkpoint.dir", "s3://no-such-bucket-here/run")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(ConfigError, match="credentials"):
        probe("checkpoint.dir", f"{s3_bucket}/run")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on port 9
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with pytest.raises(ConfigError, match="did not answer"):
        probe("checkpoint.dir", f"{s3_bucket}/run")


def test_a_missing_bucket_is_one_paragraph_and_exit_2_before_anything_is_written(
    s3_bucket: str, scratch: Path
) -> None:
    """The CLI's pre-launch checks meet the store: a bucket that is not there is the config error of
    checkpoint.dir (exit 2, no traceback, no run dir), named before any rank starts."""
    from shared_support import disttrain_in_process

    proc = disttrain_in_process(
        "train",
        "data=synthetic",
        "nproc_per_node=1",
        "checkpoint.dir=s3://no-such-bucket-here/run",
        cwd=scratch,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "checkpoint.dir=s3://no-such-bucket-here/run is not valid" in proc.stderr
    assert "does not exist at this endpoint" in proc.stderr and "Traceback" not in proc.stderr
    assert list(scratch.iterdir()) == [], "nothing written"


def test_storage_options_reach_the_store_without_the_environment(
    s3_bucket: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """storage_options={s3: {endpoint_url: ...}}: fsspec's per-protocol defaults in this process,
    over the environment's endpoint (here one nothing listens at)."""
    import fsspec.config
    import s3fs

    from disttrain import storage

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setattr(fsspec.config, "conf", {})  # restored after the test: configure() is process-wide
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(ConfigError, match="did not answer"):
        probe("checkpoint.dir", f"{s3_bucket}/run")
    storage.configure({"s3": {"endpoint_url": s3_endpoint}})
    probe("checkpoint.dir", f"{s3_bucket}/run", write=True)


def test_hf_data_files_from_s3(s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data=hf with data.path=s3://.../*.jsonl: the glob is listed in the store, datasets reads the
    objects through fsspec; a glob that matches nothing is data.path's paragraph."""
    from disttrain.data.hf import load_hf

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    rows = [{"x": [float(i), 1.0], "y": i % 2} for i in range(6)]
    ObjectPath(f"{s3_bucket}/hf/part-0.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    ds = load_hf(f"{s3_bucket}/hf/*.jsonl", columns=["x", "y"])
    assert len(ds) == 6 and ds[5]["x"].tolist() == [5.0, 1.0] and int(ds[5]["y"]) == 1
    with pytest.raises(ConfigError, match="nothing is there"):
        load_hf(f"{s3_bucket}/hf/*.parquet")


def test_a_url_is_frozen_as_given_and_a_bad_key_refused_before_launch() -> None:
    """config.yaml keeps checkpoint.dir=s3://... as written (never joined to the working directory);
    a key with a '..' segment is checkpoint.dir's paragraph, before any request."""
    from unit_support import checked

    assert checked(["checkpoint.dir=s3://lab-ckpt/gpt"])["checkpoint"]["dir"] == "s3://lab-ckpt/gpt"
    with pytest.raises(
        ConfigError, match=r"checkpoint.dir=s3://lab-ckpt/a/../b is not valid.*'\.\.' segment"
    ):
        checked(["checkpoint.dir=s3://lab-ckpt/a/../b"])
