"""disttrain.checkpoint.reading: the load path that reads each file once, straight into the live
tensors, checking it against the manifest in the same pass (crc32; sha256 in older manifests)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from disttrain import checkpoint
from disttrain.checkpoint import store
from disttrain.engine.rng import rng_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def _saved(tmp_path: Path, step: int = 1) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    model, opt = _trained()
    msd, osd = get_state_dict(model, opt)
    meta = {"step": step, "epoch": 0, "epoch_samples": 0, "samples": 0, "reason": "test"}
    checkpoint.save(
        tmp_path, step, {"model": msd, "optim": osd}, rng_state(), meta, rank=0, keep=3, verify="hash"
    )
    return tmp_path / checkpoint.step_name(step), model, opt


def _fresh_state() -> dict[str, dict]:
    msd, osd = get_state_dict(*_trained(seed=99))
    return {"model": msd, "optim": osd}


def _flip(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def _to_sha256(path: Path) -> None:
    """Rewrite the manifest as the previous version wrote it: size and sha256 of every file."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = {
        n: {"size": e["size"], "sha256": hashlib.sha256((path / n).read_bytes()).hexdigest()}
        for n, e in manifest["files"].items()
    }
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_the_fast_reader_fills_the_same_state_as_dcps_own_reader(tmp_path: Path) -> None:
    """Every tensor, whole (read into the live tensor) or not (a non-contiguous or other-dtype
    target takes DCP's path: torch.load, narrow, copy_), and the non-tensor values, as DCP loads them."""
    path, model, _opt = _saved(tmp_path)
    ours = _fresh_state()
    w = next(k for k in ours["model"] if k.endswith("weight"))
    ours["model"][w] = torch.zeros(ours["model"][w].shape[::-1]).t()  # non-contiguous: DCP's path
    b = next(k for k in ours["model"] if k.endswith("bias"))
    ours["model"][b] = ours["model"][b].double()  # another dtype: DCP's path (copy_ converts)
    theirs = _fresh_state()
    theirs["model"][w], theirs["model"][b] = torch.zeros_like(ours["model"][w]), ours["model"][b].clone()
    checkpoint.load_sharded(path, ours, rank=0, no_dist=True, verify="hash")
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    flat = lambda s: dict(torch.utils._pytree.tree_flatten_with_path(s)[0])  # noqa: E731
    mine, stock = flat(ours), flat(theirs)
    assert mine.keys() == stock.keys()
    for k, v in stock.items():
        assert torch.equal(mine[k], v) if torch.is_tensor(v) else mine[k] == v, k
    ref = model.state_dict()
    assert all(torch.equal(ours["model"][k].to(v.dtype), v) for k, v in ref.items())


@pytest.mark.parametrize("target", ["shard", "rng_rank0.pt", ".metadata", "meta.json"])
def test_a_flipped_byte_in_any_file_fails_the_load_naming_the_file(tmp_path: Path, target: str) -> None:
    """verify=hash: the shards are checked in the pass that reads them; the files the load does not
    read through DCP (rng, meta.json) or parses first (.metadata) are checked beside it."""
    path, _, _ = _saved(tmp_path)
    victim = next(path.glob("*.distcp")) if target == "shard" else path / target
    _flip(victim)
    assert checkpoint.choose(tmp_path, "size") == path, "sizes alone cannot see it"
    with pytest.raises(checkpoint.load_errors()) as info:
        checkpoint.load_sharded(path, _fresh_state(), rank=0, no_dist=True, verify="hash")
    assert victim.name in str(info.value) or target == ".metadata"  # a garbled pickle may fail first


def test_a_flip_in_a_tensor_records_zip_header_is_reported_as_corruption(tmp_path: Path) -> None:
    """The first bytes of a shard are an item's zip records: parsing fails, and the load says which
    file does not match its manifest rather than a zip error."""
    path, _, _ = _saved(tmp_path)
    shard = next(path.glob("*.distcp"))
    _flip(shard, at=0.0001)
    with pytest.raises(
        checkpoint.CorruptCheckpoint, match=f"{shard.name} has the right size but the wrong crc32"
    ):
        checkpoint.load_sharded(path, _fresh_state(), rank=0, no_dist=True, verify="hash")


def test_a_checkpoint_with_an_older_sha256_manifest_loads_and_is_still_verified(tmp_path: Path) -> None:
    """Backward compatibility: run dirs made by the previous version (sha256 manifests) resume."""
    path, model, _ = _saved(tmp_path)
    _to_sha256(path)
    assert checkpoint.problem(path) is None
    state = _fresh_state()
    checkpoint.load_sharded(path, state, rank=0, no_dist=True, verify="hash")
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
    _flip(next(path.glob("*.distcp")))
    with pytest.raises(checkpoint.CorruptCheckpoint, match="the wrong sha256"):
        checkpoint.load_sharded(path, _fresh_state(), rank=0, no_dist=True, verify="hash")
    assert "wrong sha256" in (checkpoint.problem(path) or "")


def test_verify_size_reads_no_checksum_and_a_truncated_shard_still_fails(tmp_path: Path) -> None:
    path, _, _ = _saved(tmp_path)
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    assert "truncated" in (checkpoint.problem(path, "size") or "")
    with pytest.raises(checkpoint.load_errors()):
        checkpoint.load_sharded(path, _fresh_state(), rank=0, no_dist=True, verify="size")


def test_the_manifest_checksum_is_zlib_crc32_of_the_file(tmp_path: Path) -> None:
    import zlib

    path, _, _ = _saved(tmp_path)
    files = json.loads((path / "manifest.json").read_text())["files"]
    for name, entry in files.items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name
    assert store._file_digest(path / "meta.json", True) == files["meta.json"]
