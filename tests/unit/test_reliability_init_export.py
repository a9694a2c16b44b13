"""init.path sources, export, eval/predict and full disks that misbehave (review
2026-11-28-reliability D7-D13, D18-D21), each in one process with tiny files.

Every test is named after the defect it reproduces; docs/reliability.md lists them.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import pickle
import struct
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from disttrain import checkpoint
from disttrain.checkpoint import init_from
from disttrain.checkpoint.reading import CorruptCheckpoint, file_digest
from disttrain.config.errors import ConfigError
from disttrain.config.schema import InitConfig
from disttrain.config.typed import typed
from disttrain.rng import rng_state
from disttrain.rundir import read_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _init(path: Path | str, **init: object) -> InitConfig:
    return typed(InitConfig, {"path": str(path), **init})


def _refused(path: Path | str, model: nn.Module | None = None) -> str:
    """init.path's pre-launch check must refuse in one init.path paragraph (never a traceback)."""
    with pytest.raises(ConfigError) as err:
        init_from.check(_init(path), model if model is not None else Net())
    assert err.value.key == "init.path"
    text = str(err.value)
    assert "weights_only` set to `False`" not in text and "Re-running" not in text
    return text


def _save_dcp(ckpt_dir: Path, step: int, model: nn.Module) -> Path:
    """A checkpoint as a run saves it: the model's and the (initialised) optimizer's state dicts."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, torch.optim.AdamW(model.parameters()))
    meta = {"step": step, "epoch": 0, "epoch_samples": 0, "samples": 0, "reason": "test"}
    checkpoint.save(
        ckpt_dir, step, {"model": msd, "optim": osd}, rng_state(), meta, rank=0, keep=5, verify="hash"
    )
    return ckpt_dir / checkpoint.step_name(step)


def _rewrite_metadata(step: Path, relative_path: Any) -> None:
    """Point every item of `.metadata` at `relative_path(name)` and re-hash it in the manifest
    (what someone crafting a checkpoint does). The test's own pickle: trusted."""
    meta_file = step / ".metadata"
    metadata = pickle.loads(meta_file.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = relative_path(info.relative_path)
    meta_file.write_bytes(pickle.dumps(metadata))
    manifest = json.loads((step / checkpoint.MANIFEST).read_text())
    manifest["files"][".metadata"] = file_digest(meta_file, "xxh3_64")
    (step / checkpoint.MANIFEST).write_text(json.dumps(manifest))


# --------------------------------------------------------------------------------------- D7
def test_d7_metadata_storage_paths_outside_the_folder_are_never_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    step = _save_dcp(tmp_path / "ck", 1, _net(0))
    outside = tmp_path / "outside"
    outside.mkdir()
    other = _save_dcp(
        tmp_path / "other", 1, _net(1)
    )  # another model's shards, named by the crafted .metadata
    for shard in step.glob("*.distcp"):
        (outside / shard.name).write_bytes((other / shard.name).read_bytes())
    _rewrite_metadata(step, lambda name: f"../../outside/{name}")
    model = _net(2)
    with caplog.at_level(logging.WARNING, "disttrain"), pytest.raises(FileNotFoundError):
        checkpoint.load_model(tmp_path / "ck", model)  # export's load: nothing loadable is left
    assert "outside the checkpoint folder" in caplog.text
    assert torch.equal(model.a.weight, _net(2).a.weight)  # the outside weights never arrived
    assert "outside the checkpoint folder" in _refused(step)  # init.path: one paragraph, before launch


def test_d7_a_fifo_in_a_checkpoint_is_refused_without_blocking(tmp_path: Path) -> None:
    from disttrain.checkpoint.reading import open_regular

    fifo = tmp_path / "__0_0.distcp"
    os.mkfifo(fifo)
    done: list[BaseException] = []
    t = threading.Thread(target=lambda: done.append(_raises(lambda: open_regular(fifo))), daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # before the fix: open() blocks until a writer comes; release it and fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("opening a FIFO named by a checkpoint blocked")
    assert isinstance(done[0], CorruptCheckpoint) and "not a regular file" in str(done[0])
    step = _save_dcp(tmp_path / "ck", 1, _net(0))
    os.mkfifo(tmp_path / "ck" / "pipe")  # a name the manifest does not list, beside the shards
    _rewrite_metadata(step, lambda name: "pipe")
    assert "does not list" in _refused(step)


def _raises(fn: Any) -> BaseException:
    try:
        fn()
    except BaseException as exc:
        return exc
    raise AssertionError("no exception")


# --------------------------------------------------------------------------------------- D8
def _hf_folder(folder: Path, weight_map: Any, shards: dict[str, dict[str, torch.Tensor]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, tensors in shards.items():
        save_file(tensors, str(folder / name))
    (folder / init_from.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    return folder


def _sd(seed: int = 0) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _net(seed).state_dict().items()}


def test_d8_index_shards_outside_the_folder_or_not_regular_files_are_refused(tmp_path: Path) -> None:
    sd = _sd()
    a = {k: sd[k] for k in ("a.weight", "a.bias")}
    b = {k: sd[k] for k in ("b.weight", "b.bias")}
    save_file(b, str(tmp_path / "secret.safetensors"))
    wm = dict.fromkeys(a, "model-00001.safetensors")
    outside = _hf_folder(
        tmp_path / "rel", {**wm, **dict.fromkeys(b, "../secret.safetensors")}, {"model-00001.safetensors": a}
    )
    absolute = str(tmp_path / "secret.safetensors")
    absolute_dir = _hf_folder(
        tmp_path / "abs", {**wm, **dict.fromkeys(b, absolute)}, {"model-00001.safetensors": a}
    )
    assert "outside the checkpoint folder" in _refused(outside)
    assert "outside the checkpoint folder" in _refused(absolute_dir)
    linked = _hf_folder(
        tmp_path / "link",
        {**wm, **dict.fromkeys(b, "model-00002.safetensors")},
        {"model-00001.safetensors": a},
    )
    (linked / "model-00002.safetensors").symlink_to(tmp_path / "secret.safetensors")
    assert "outside the model folder" in _refused(linked)
    piped = _hf_folder(
        tmp_path / "fifo", {**wm, **dict.fromkeys(b, "pipe.safetensors")}, {"model-00001.safetensors": a}
    )
    os.mkfifo(piped / "pipe.safetensors")
    done: list[str] = []
    t = threading.Thread(target=lambda: done.append(_refused(piped)), daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():
        os.close(os.open(piped / "pipe.safetensors", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("an index naming a FIFO blocked the pre-launch check")
    assert "not a regular file" in done[0]


# --------------------------------------------------------------------------------------- D9
def test_d9_a_pickle_gadget_and_a_legacy_pt_are_one_paragraph_without_torchs_advice(tmp_path: Path) -> None:
    class Gadget:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {tmp_path / 'PWNED'}",))

    torch.save({"a.weight": Gadget()}, tmp_path / "gadget.pt")
    assert "not plain tensors" in (text := _refused(tmp_path / "gadget.pt")) and "posix.system" in text
    assert not (tmp_path / "PWNED").exists()
    torch.save(_sd(), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert "legacy (non-zip)" in _refused(tmp_path / "legacy.pt")


def _safetensors_with(path: Path, header: bytes, length: int | None = None, body: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + body)
    return path


def test_d9_malformed_safetensors_and_dev_zero_are_one_paragraph(tmp_path: Path) -> None:
    big = _safetensors_with(tmp_path / "big.safetensors", b"{}", length=2**62)
    not_json = _safetensors_with(tmp_path / "nj.safetensors", b"not json")
    header = json.dumps({"a.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    past_end = _safetensors_with(
        tmp_path / "past.safetensors", header + b" " * (-len(header) % 8), body=b"\0" * 8
    )
    for f in (big, not_json, past_end):
        text = _refused(f)
        assert f.name in text and "not a readable safetensors file" in text
    zero = _hf_folder(tmp_path / "zero", {"a.weight": "/dev/zero"}, {})
    assert "outside the checkpoint folder" in _refused(zero)


def test_d9_an_index_that_disagrees_with_its_shards_is_refused_before_launch(tmp_path: Path) -> None:
    sd = _sd()
    shards = {
        "s1.safetensors": {k: sd[k] for k in ("a.weight", "a.bias")},
        "s2.safetensors": {k: sd[k] for k in ("b.weight", "b.bias")},
    }
    good = {
        "a.weight": "s1.safetensors",
        "a.bias": "s1.safetensors",
        "b.weight": "s2.safetensors",
        "b.bias": "s2.safetensors",
    }
    init_from.check(_init(_hf_folder(tmp_path / "ok", good, shards)), Net())  # the well-formed folder loads
    one = {"all.safetensors": sd}  # one shard holds every key; the index lists two of them
    omits = _hf_folder(tmp_path / "omits", dict.fromkeys(("a.weight", "a.bias"), "all.safetensors"), one)
    assert "omits keys its shards hold (2): b.bias, b.weight" in _refused(omits)
    wrong = _hf_folder(tmp_path / "wrong", {**good, "b.weight": "s1.safetensors"}, shards)
    assert "does not hold the key (1): b.weight -> s1.safetensors" in _refused(wrong)
    missing = _hf_folder(tmp_path / "missing", {**good, "b.bias": "s3.safetensors"}, shards)
    assert "s3.safetensors is missing" in _refused(missing)
    as_list = _hf_folder(tmp_path / "list", ["a.weight"], shards)
    assert '"weight_map" is a list' in _refused(as_list)


def test_d9_a_dcp_metadata_gadget_is_one_paragraph(tmp_path: Path) -> None:
    step = _save_dcp(tmp_path / "ck", 1, _net(0))

    class Gadget:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {tmp_path / 'PWNED'}",))

    (step / ".metadata").write_bytes(pickle.dumps(Gadget()))
    manifest = json.loads((step / checkpoint.MANIFEST).read_text())
    manifest["files"][".metadata"] = file_digest(step / ".metadata", "xxh3_64")
    (step / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    text = _refused(step)
    assert "is not DCP checkpoint metadata" in text and "posix.system" in text
    assert not (tmp_path / "PWNED").exists()


# --------------------------------------------------------------------------------------- D10
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_d10_int_and_bool_sources_under_float_parameters_are_refused(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    sd = _sd()
    save_file(
        {k: (v * 1000).to(dtype) if k == "b.weight" else v for k, v in sd.items()},
        str(tmp_path / "m.safetensors"),
    )
    text = _refused(tmp_path / "m.safetensors")
    kind = "bool" if dtype == torch.bool else "int"
    assert f"dtype mismatch (1): b.weight model float vs source {kind}" in text
    torch.save({k: v.double() for k, v in sd.items()}, tmp_path / "f64.pt")  # float to float: a plain cast
    init_from.check(_init(tmp_path / "f64.pt"), Net())
    model = Net()
    init_from.apply(_init(tmp_path / "f64.pt"), model, is_zero=True)
    assert torch.equal(model.b.weight, sd["b.weight"])


# --------------------------------------------------------------------------------------- D18
def _deflated_pt(path: Path, obj: Any) -> Path:
    buf = io.BytesIO()
    torch.save(obj, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    with zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    return path


def test_d18_a_deflated_pt_as_a_data_file_is_refused_before_it_inflates(tmp_path: Path) -> None:
    from disttrain.data import build_datasets

    n = 4_000_000
    bomb = _deflated_pt(
        tmp_path / "val.pt",
        {"x": torch.zeros(n, 1, dtype=torch.uint8), "y": torch.zeros(n, dtype=torch.uint8)},
    )
    assert bomb.stat().st_size < n // 100
    spec = {"_target_": "disttrain.data.files.load_files", "path": str(bomb), "targets": "classes"}
    with pytest.raises(ConfigError) as err:
        build_datasets({"train": spec, "val": spec, "path": str(bomb)})
    assert err.value.key == "data.path" and "is compressed" in str(err.value)


# --------------------------------------------------------------------------------------- export
@pytest.fixture(scope="module")
def mlp_config() -> dict[str, Any]:
    from unit_support import checked

    return checked(["data=synthetic", "trainer.max_steps=30"])


def _run_dir(root: Path, cfg: dict[str, Any], steps: tuple[int, ...] = (10,)) -> Path:
    """A run dir with `cfg` frozen and a checkpoint of its model per step (seeded by the step)."""
    import yaml

    from disttrain.config.run import Run
    from disttrain.models import build_model

    run_dir = root / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    for step in steps:
        torch.manual_seed(step)
        _save_dcp(run_dir / "checkpoints", step, build_model(Run.of(cfg).model))
    return run_dir


def test_d20_export_hf_to_a_link_is_refused_before_loading(tmp_path: Path) -> None:
    from disttrain.commands.export import check_out_dir

    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for link in ("link", "dangling"):
        with pytest.raises(ConfigError, match="is a link to") as err:
            check_out_dir(tmp_path / link, "--out")
        assert err.value.key == "--out"
    check_out_dir(tmp_path / "empty", "--out")  # an empty folder itself is fine
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_d19_export_onto_a_full_disk_names_the_folder_and_the_space_free(
    tmp_path: Path, mlp_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    from disttrain.checkpoint import export as ckpt_export
    from disttrain.commands.export import export

    run_dir = _run_dir(tmp_path, mlp_config)

    def full(*_: Any, **__: Any) -> None:  # what torch's zip writer and safetensors raise on ENOSPC
        if suffix == ".pt":
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 34496 vs 34448"
            ) from (OSError(errno.ENOSPC, "No space left on device"))
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ckpt_export, "save_atomic", full)
    monkeypatch.setattr("safetensors.torch.save_model", full)
    out = tmp_path / "small" / f"m{suffix}"
    with pytest.raises(ConfigError) as err:
        export(run_dir, run_dir, out)
    assert err.value.key == "--out"
    assert f"{out.parent} is full" in str(err.value) and " free, the export needs ~" in str(err.value)
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_d19_a_rank_save_onto_a_full_disk_is_an_error_the_launcher_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP wraps the ENOSPC in a CheckpointException, a BaseException: spawn's and torchelastic's
    error recording take Exceptions only, so the console said "exited with code 1 before Python
    could record an error"."""
    from disttrain.checkpoint.manager import DiskFull, named_disk_full

    _save_dcp(tmp_path, 5, _net(0))
    real_open = os.open

    def full(path: Any, flags: int, *args: Any) -> int:
        if str(path).endswith(".distcp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", full)
    with pytest.raises(Exception) as err, named_disk_full(tmp_path):
        _save_dcp(tmp_path, 10, _net(0))
    assert isinstance(err.value, DiskFull), type(err.value)
    assert f"checkpoint.dir {tmp_path} is full" in str(err.value)
    assert checkpoint.committed(tmp_path)[-1].name == "step_00000005"  # the previous one stays


# --------------------------------------------------------------------------------------- D11, D21
def _prune_after_choosing(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`checkpoint.choose` as a training run with keep-N meets it: the newest checkpoint it picks
    is removed just after (once), before anything of it is read."""
    import shutil

    real, pruned = checkpoint.choose, []

    def choose(*args: Any, **kwargs: Any) -> Path | None:
        found = real(*args, **kwargs)
        if found is not None and not pruned:
            pruned.append(found.name)
            shutil.rmtree(found)
        return found

    monkeypatch.setattr(checkpoint, "choose", choose)
    return pruned


def test_d11_init_path_of_a_training_run_takes_the_next_newest_when_its_choice_is_pruned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for step in (1, 2):
        _save_dcp(tmp_path, step, _net(step))
    pruned = _prune_after_choosing(monkeypatch)
    model = Net()
    with caplog.at_level(logging.INFO, "disttrain"):
        init_from.check(_init(tmp_path), Net())
        init_from.apply(_init(tmp_path), model, is_zero=True)
    assert pruned == ["step_00000002"] and "step_00000002 was pruned meanwhile" in caplog.text
    assert torch.equal(model.a.weight, _net(1).a.weight)  # the next newest, step 1


def test_d21_export_passes_over_a_checkpoint_pruned_mid_read_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    from disttrain.checkpoint import export as ckpt_export

    for step in (1, 2):
        _save_dcp(tmp_path, step, _net(step))
    real = ckpt_export.load_sharded

    def pruned_while_read(path: Path, *args: Any, **kwargs: Any) -> Any:
        if path.name == "step_00000002":
            shutil.rmtree(path)  # keep-N of the training run, between the choice and the read
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ckpt_export, "load_sharded", pruned_while_read)
    model = Net()
    with caplog.at_level(logging.INFO):
        assert checkpoint.load_model(tmp_path, model).name == "step_00000001"
    assert torch.equal(model.a.weight, _net(1).a.weight)
    assert "step_00000002 was pruned while it was read" in caplog.text
    loud = [r.getMessage()[:120] for r in caplog.records if r.levelno >= logging.WARNING]
    assert loud == [], loud  # no "not loadable ... falling back", no DCP "Global metadata" traceback


def test_d21_eval_passes_over_a_checkpoint_pruned_mid_read_quietly(
    tmp_path: Path,
    mlp_config: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import shutil

    run_dir = _run_dir(tmp_path, mlp_config, steps=(10, 20))
    real = checkpoint.load_sharded

    def pruned_while_read(path: Path, *args: Any, **kwargs: Any) -> Any:
        if path.name == "step_00000020":
            shutil.rmtree(path)  # keep-N of the training run, between rank 0's choice and the read
        return real(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "load_sharded", pruned_while_read)
    with caplog.at_level(logging.INFO):
        assert _single_restore(run_dir, run_dir / "checkpoints")[0].name == "step_00000010"
    assert "step_00000020 was pruned while it was read" in caplog.text
    loud = [r.getMessage()[:120] for r in caplog.records if r.levelno >= logging.WARNING]
    assert loud == [], loud


# --------------------------------------------------------------------------------------- D13
def _single_restore(run_dir: Path, location: Path) -> tuple[Path, int]:
    from disttrain.config.run import Run
    from disttrain.dist import DistEnv
    from disttrain.eval_worker import restore
    from disttrain.models import build_model
    from disttrain.rundir import read_config
    from disttrain.strategies.base import Strategy
    from disttrain.strategies.specs.data_parallel import SingleStrategyConfig

    run = Run.of(read_config(run_dir))
    env = DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu"))
    model = build_model(run.model)
    return restore(run, env, Strategy(SingleStrategyConfig(), env), model, location)


def test_d13_a_named_checkpoint_that_fails_to_load_is_an_error_never_an_older_one(
    tmp_path: Path, mlp_config: dict[str, Any]
) -> None:
    from disttrain.commands.evaluate import _check_checkpoint

    run_dir = _run_dir(tmp_path, mlp_config, steps=(10, 20))
    named = run_dir / "checkpoints" / "step_00000020"
    shard = next(named.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte: sizes agree, the checksum does not
    shard.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=r"checkpoint .*step_00000020 is not loadable"):
        _single_restore(run_dir, named)  # the ranks: no fallback to step_10
    assert (
        _single_restore(run_dir, run_dir / "checkpoints")[0].name == "step_00000010"
    )  # a run dir: falls back
    shard.write_bytes(bytes(data[:-8]))  # cut short: the command sees it before launch
    with pytest.raises(ConfigError, match="step_00000020") as err:
        _check_checkpoint(named, str(named))
    assert err.value.key == "RUN_DIR" and "never an older one" in str(err.value)


def test_d13_another_models_checkpoint_is_refused_before_launch(
    tmp_path: Path, mlp_config: dict[str, Any]
) -> None:
    from shared_support import disttrain_in_process

    run_dir = _run_dir(tmp_path, mlp_config, steps=())
    _save_dcp(run_dir / "checkpoints", 30, _net(0))  # a Net's weights in the MLP's run
    proc = disttrain_in_process("eval", str(run_dir), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "missing in the source" in proc.stderr and "saved from another model" in proc.stderr
    assert "Traceback" not in proc.stderr and not (run_dir / "evals").exists()  # no rank started


def test_d13_the_predict_line_names_the_checkpoint_it_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from disttrain.commands.evaluate import report

    out = tmp_path / "p.jsonl"
    out.write_text('{"index": 0, "output": [1]}\n')
    report("predict", out, {"out": str(out), "checkpoint": str(tmp_path / "step_00000020"), "step": 20})
    assert capsys.readouterr().out == f"predict: 1 rows from step_00000020 (step 20) -> {out} (28 B)\n"


# --------------------------------------------------------------------------------------- D12
def test_d12_export_rebuilds_from_the_base_config_the_run_trained_with(
    tmp_path: Path, mlp_config: dict[str, Any], tiny_gpt2: Path
) -> None:
    import shutil

    from disttrain.commands.export import export
    from disttrain.config.run import Run
    from disttrain.preflight import hf_base

    transformers = pytest.importorskip("transformers")
    tiny = Path(shutil.copytree(tiny_gpt2, tmp_path / "tiny"))  # its config is edited, then removed
    hf = {
        "_target_": "transformers.AutoModelForCausalLM.from_pretrained",
        "pretrained_model_name_or_path": str(tiny),
    }
    run_dir = _run_dir(tmp_path, {**mlp_config, "model": hf}, steps=())
    hf_base.record(
        run_dir, Run.of(read_config(run_dir)).model
    )  # what `train` does after freezing the run dir
    trained = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p))
    _save_dcp(run_dir / "checkpoints", 4, trained)
    base_config = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(
        json.dumps({**base_config, "activation_function": "relu"})
    )  # a new revision
    export(run_dir, run_dir, tmp_path / "after", "hf")
    after = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "after")
    assert after.config.activation_function == base_config["activation_function"] != "relu"
    x = torch.arange(16)[None]
    assert torch.allclose(after(x).logits, trained.eval()(x).logits, atol=1e-6)
    shutil.rmtree(tiny)  # the base folder is gone: the run dir's copy of its config still builds it
    export(run_dir, run_dir, tmp_path / "gone.pt", "pt")
    assert torch.equal(torch.load(tmp_path / "gone.pt")["lm_head.weight"], trained.lm_head.weight)
    shutil.rmtree(run_dir / hf_base.BASE)  # a run dir frozen before the copy existed: one paragraph
    with pytest.raises(ConfigError) as err:
        export(run_dir, run_dir, tmp_path / "none.pt", "pt")
    assert err.value.key == "model.pretrained_model_name_or_path" and str(tiny) in str(err.value)
