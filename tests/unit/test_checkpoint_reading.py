"""disttrain.checkpoint.reading: the load path that reads each file once, straight into the live
tensors, checking it against the manifest in the same pass (xxh3_64; crc32 or sha256 in the
manifests of older versions), and refusing a manifest that names any other checksum."""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from disttrain import checkpoint
from disttrain.checkpoint import files as ckpt_files
from disttrain.rng import rng_state

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


OLDER = {  # what earlier versions wrote into a manifest, written here by hand (not through disttrain)
    "crc32": lambda data: f"{zlib.crc32(data):08x}",
    "sha256": lambda data: hashlib.sha256(data).hexdigest(),
}


def _to_older(path: Path, algo: str) -> None:
    """Rewrite the manifest as an older version wrote it: size and `algo` of every file."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = {
        n: {"size": e["size"], algo: OLDER[algo]((path / n).read_bytes())}
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
        checkpoint.CorruptCheckpoint, match=f"{shard.name} has the right size but the wrong xxh3_64"
    ):
        checkpoint.load_sharded(path, _fresh_state(), rank=0, no_dist=True, verify="hash")


@pytest.mark.parametrize("algo", ["crc32", "sha256"])
def test_a_checkpoint_with_an_older_manifest_loads_and_is_still_verified(tmp_path: Path, algo: str) -> None:
    """Backward compatibility: run dirs made by older versions (crc32 or sha256 manifests) resume,
    and a flipped byte in them is still found, by the load and by the manifest check alike."""
    path, model, _ = _saved(tmp_path)
    _to_older(path, algo)
    assert checkpoint.problem(path) is None
    state = _fresh_state()
    checkpoint.load_sharded(path, state, rank=0, no_dist=True, verify="hash")
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
    shard = next(path.glob("*.distcp"))
    _flip(shard)
    with pytest.raises(
        checkpoint.CorruptCheckpoint, match=f"{shard.name} has the right size but the wrong {algo}"
    ):
        checkpoint.load_sharded(path, _fresh_state(), rank=0, no_dist=True, verify="hash")
    assert f"wrong {algo}" in (checkpoint.problem(path) or "")


def test_a_flipped_byte_under_an_older_manifest_falls_back_to_the_previous_checkpoint(tmp_path: Path) -> None:
    """The newest checkpoint (crc32 manifest) has a flipped byte, the one before (sha256) is whole:
    the manifest check passes over the newest, naming its file, and the older one loads."""
    older, model, _ = _saved(tmp_path, step=1)
    newest, _, _ = _saved(tmp_path, step=2)
    _to_older(older, "sha256")
    _to_older(newest, "crc32")
    _flip(next(newest.glob("*.distcp")))
    assert checkpoint.choose(tmp_path, "size") == newest, "sizes alone cannot see it"
    assert checkpoint.choose(tmp_path) == older
    state = _fresh_state()
    checkpoint.load_sharded(older, state, rank=0, no_dist=True, verify="hash")
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"blake3": "00" * 32}, "carries checksum 'blake3', which this version cannot check"),
        ({"os.system": "touch pwned"}, "carries checksum 'os.system', which this version cannot check"),
        ({"xxh3_64": "0" * 16, "crc32": "0" * 8}, "carries 2 checksums"),
        ({"xxh3_64": 12}, "has xxh3_64 '12', not a hex string"),
        ({"size": "12", "xxh3_64": "0" * 16}, "has size '12', not a byte count"),
    ],
)
def test_a_manifest_entry_this_version_cannot_check_is_refused_and_the_previous_checkpoint_used(
    tmp_path: Path, entry: dict, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checksum not in the fixed table (a newer version's, or a corrupted name) is never taken for
    a sizes-only entry nor looked up by name: the manifest check and the load both refuse it, and
    the fallback takes the checkpoint before."""
    monkeypatch.chdir(tmp_path)
    older, _, _ = _saved(tmp_path, step=1)
    newest, _, _ = _saved(tmp_path, step=2)
    manifest = json.loads((newest / "manifest.json").read_text())
    shard = next(newest.glob("*.distcp")).name
    manifest["files"][shard] = {"size": manifest["files"][shard]["size"], **entry}
    (newest / "manifest.json").write_text(json.dumps(manifest))
    want = f"manifest.json: the entry for '{shard}' {says}"
    for verify in ("hash", "size"):
        assert want in (checkpoint.problem(newest, verify) or ""), verify
        assert checkpoint.choose(tmp_path, verify) == older
    with pytest.raises(checkpoint.CorruptCheckpoint, match=re.escape(want)):
        checkpoint.load_sharded(newest, _fresh_state(), rank=0, no_dist=True, verify="hash")
    assert not (tmp_path / "pwned").exists()


def test_verify_size_reads_no_checksum_and_a_truncated_shard_still_fails(tmp_path: Path) -> None:
    path, _, _ = _saved(tmp_path)
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    assert "truncated" in (checkpoint.problem(path, "size") or "")
    with pytest.raises(checkpoint.load_errors()):
        checkpoint.load_sharded(path, _fresh_state(), rank=0, no_dist=True, verify="size")


def test_the_manifest_checksum_is_xxh3_64_of_the_file(tmp_path: Path) -> None:
    path, _, _ = _saved(tmp_path)
    files = json.loads((path / "manifest.json").read_text())["files"]
    for name, entry in files.items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}, name
    assert ckpt_files._file_digest(path / "meta.json", True) == files["meta.json"]
