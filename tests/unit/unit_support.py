"""Unit-test helpers: compose in-process as the CLI does, or run the real `disttrain` in a scratch cwd.

Subprocesses run in their own session with a timeout; on a timeout the whole group is killed, so a
check that wrongly starts ranks can neither hang the suite nor leave processes behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from shared_support import SCRUB
from shared_support import disttrain_in_process as disttrain_in_process  # the unit tests import it here
from shared_support import said as said

from disttrain.config import compose, resolve
from disttrain.config.run import Run
from disttrain.preflight.checks import check_runtime, check_static

# The console script installed next to this interpreter: the entry point users run.
CLI = (
    shutil.which("disttrain", path=str(Path(sys.executable).parent))
    or shutil.which("disttrain")
    or "disttrain"
)

# Enough for a config error through `disttrain train` (torch import + building the data set);
# a check that wrongly launched ranks would run into it.
CLI_TIMEOUT = 60.0


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SCRUB}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_env(**extra: str) -> dict[str, str]:
    """The clean environment plus `extra` (e.g. PYTHONPROFILEIMPORTTIME=1)."""
    return {**clean_env(), **extra}


def run(
    cmd: Sequence[str], cwd: Path, timeout: float = CLI_TIMEOUT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `cmd` in `cwd` in its own session; kill the whole group if it outlives `timeout`."""
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=env or clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:  # the timeout, pytest-timeout or Ctrl-C: never leave a process behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        if isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
            pytest.fail(f"`{' '.join(cmd)}` did not finish in {timeout:.0f} s\n--- stderr\n{err[-3000:]}")
        raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def disttrain(
    *args: str, cwd: Path, timeout: float = CLI_TIMEOUT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The real `disttrain ARGS...` console script, run in `cwd`."""
    return run([CLI, *args], cwd, timeout, env)


def checked(
    overrides: Sequence[str],
    runtime: bool = False,
    config_dir: str | None = None,
    config_name: str = "config",
) -> dict[str, Any]:
    """What the CLI does before launching (`checked_run`), as the plain config config.yaml holds."""
    return checked_run(overrides, runtime, config_dir, config_name).to_dict()


ONE_RANK = ("nproc_per_node=1", "trainer.progress=false", "threads_per_rank=1", "observe.sinks=[]")


def train_in_process(run_dir: Path, *overrides: str) -> dict[str, Any]:
    """worker.train of the checked config `ONE_RANK + overrides` into `run_dir` (what rank 0 of one
    does; a process group of one must exist, the `one_rank` fixture): the summary."""
    import torch

    from disttrain.dist import DistEnv
    from disttrain.worker import train

    cfg = checked([*ONE_RANK, *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    return train(Run.of(cfg), DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu")), run_dir)


def train_records(run_dir: Path) -> list[dict[str, Any]]:
    """The train-metric records of a run's metrics.jsonl."""
    from disttrain.observe.metrics import read_metrics

    return [r for r in read_metrics(run_dir) if "train/loss" in r]


def checked_run(
    overrides: Sequence[str],
    runtime: bool = False,
    config_dir: str | None = None,
    config_name: str = "config",
) -> Run:
    """What the CLI does before launching: compose, resolve once, the Run, static (and runtime) checks."""
    run = Run.of(resolve(compose(list(overrides), config_dir, config_name), list(overrides)))
    check_static(run)
    if runtime:
        check_runtime(run)
    return run


def engine_of(run_dir: Path, overrides: Sequence[str]) -> Any:
    """disttrain's Engine for the checked overrides, built as a rank builds it (worker.build_parts +
    build_engine) at world size 1 on the CPU, in this process (a process group must exist)."""
    import torch

    from disttrain.dist import DistEnv
    from disttrain.observe.metrics import make_metrics
    from disttrain.worker import build_engine, build_parts

    run = Run.of(checked(overrides))
    env = DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu"))
    run_dir.mkdir(parents=True, exist_ok=True)
    strategy, parts = build_parts(run, env)
    return build_engine(run, env, run_dir, strategy, parts, make_metrics(run_dir, True, run))


def write_module(root: Path, dotted: str, source: str) -> Path:
    """Write `source` as module `dotted` (e.g. 'mylab.nets') under `root`, with package __init__s."""
    parts = dotted.split(".")
    for i in range(1, len(parts)):
        pkg = root.joinpath(*parts[:i])
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").touch()
    path = root.joinpath(*parts[:-1], f"{parts[-1]}.py")
    path.write_text(source)
    return path


# ----------------------------------------------------------------------------------- bad inputs
@dataclass(frozen=True)
class Bad:
    """One user mistake: the command-line words after the subcommand, and the error it must give.

    `key` and `value` are what the message names (`config error: KEY=VALUE is not valid ...`).
    `runtime` mistakes are only visible to `check_runtime` (they need torch), so the CLI catches them
    in `disttrain train`, still before any rank starts; the others `disttrain config` catches too.
    """

    id: str
    argv: tuple[str, ...]
    key: str
    value: str
    runtime: bool = False
    cpu_only: bool = False  # a mistake only on a machine without CUDA GPUs
    files: tuple[str, ...] = ()  # empty files the mistake needs in the working directory

    def make_files(self, cwd: Path) -> None:
        for name in self.files:
            (cwd / name).touch()

    def shown(self, cwd: Path) -> str:
        """The value the message names: a file of the working directory by its absolute path
        (composition makes existing paths absolute: review 2026-11-28-reliability D4)."""
        return str(cwd / self.value) if self.value in self.files else self.value

    @property
    def param(self) -> Any:
        import torch

        marks = [pytest.mark.skipif(torch.cuda.is_available(), reason="valid here: CUDA GPUs present")]
        return pytest.param(self, id=self.id, marks=marks if self.cpu_only else [])


# fmt: off
BAD_STATIC = [
    Bad("unknown-key", ("optim.lrr=1",), "optim.lrr", "1"),
    Bad("unknown-key-other-option", ("sched=constant", "sched.min_lr_ratio=0.1"), "sched.min_lr_ratio", "0.1"),
    Bad("wrong-type-float", ("optim.lr=abc",), "optim.lr", "abc"),
    Bad("wrong-type-int", ("nproc_per_node=two",), "nproc_per_node", "two"),
    Bad("scalar-for-list", ("model.hidden=abc",), "model.hidden", "abc"),
    Bad("null-for-required", ("optim.lr=null",), "optim.lr", "null"),
    Bad("unparsable-override", ("optim.lr=[1",), "override", "optim.lr=[1"),
    Bad("sweep-without-m", ("optim.lr=1e-3,1e-2",), "optim.lr", "1e-3,1e-2"),
    Bad("unknown-option", ("strategy=nope",), "strategy", "nope"),
    Bad("unknown-data-option", ("data=imagenet",), "data", "imagenet"),
    Bad("unknown-experiment", ("experiment=nope",), "experiment", "nope"),
    Bad("nproc-zero", ("nproc_per_node=0",), "nproc_per_node", "0"),
    Bad("batch-zero", ("trainer.batch_size=0",), "trainer.batch_size", "0"),
    Bad("max-steps-zero", ("trainer.max_steps=0",), "trainer.max_steps", "0"),
    Bad("grad-accum-zero", ("trainer.grad_accum=0",), "trainer.grad_accum", "0"),
    Bad("clip-zero", ("trainer.clip_grad_norm=0",), "trainer.clip_grad_norm", "0.0"),
    Bad("single-two-ranks", ("strategy=single", "nproc_per_node=2"), "strategy", "single"),
    Bad("scale-lr", ("optim.scale_lr=quadratic",), "optim.scale_lr", "quadratic"),
    Bad("lr-negative", ("optim.lr=-1",), "optim.lr", "-1.0"),
    Bad("min-lr-ratio", ("sched.min_lr_ratio=2",), "sched.min_lr_ratio", "2.0"),
    Bad("backend-name", ("backend.name=mpi",), "backend.name", "mpi"),
    Bad("node-rank", ("node_rank=1",), "node_rank", "1"),
    Bad("spawn-two-nodes", ("launcher=spawn", "nodes=2", "master_addr=10.0.0.1"), "launcher", "spawn"),
    Bad("threads-zero", ("threads_per_rank=0",), "threads_per_rank", "0"),
    Bad("amp-name", ("amp.name=fp4",), "amp.name", "fp4"),
    Bad("amp-dtype-mismatch", ("amp=bf16", "amp.dtype=float16"), "amp.dtype", "float16"),
    Bad("fp16-with-zero", ("amp=fp16", "strategy=zero"), "amp", "fp16"),
    Bad("amp-with-pipeline", ("amp=bf16", "strategy=pipeline"), "amp", "bf16"),
    Bad("prefetch-without-workers", ("data.prefetch_factor=4",), "data.prefetch_factor", "4"),
    Bad("workers-negative", ("data.num_workers=-1",), "data.num_workers", "-1"),
    Bad("detect-anomaly", ("trainer.detect_anomaly=maybe",), "trainer.detect_anomaly", "maybe"),
    Bad("task", ("data.task=ranking",), "data.task", "ranking"),  # moved to the task group: migration
    Bad("targets", ("data.targets=labels",), "data.targets", "labels"),
    Bad("oom-mode", ("trainer.oom=retry",), "trainer.oom", "retry"),
    Bad("oom-retry-ddp", ("strategy=ddp", "trainer.oom=auto_microbatch"), "trainer.oom", "auto_microbatch"),
    Bad("oom-retry-fsdp", ("strategy=fsdp", "trainer.oom=auto_microbatch"), "trainer.oom", "auto_microbatch"),
    Bad("sync-check-fsdp", ("strategy=fsdp", "debug.check_sync_every=10"), "debug.check_sync_every", "10"),
    Bad("compile-pipeline", ("strategy=pipeline", "trainer.compile=true"), "trainer.compile", "true"),
    Bad("compile-mode", ("trainer.compile=whole",), "trainer.compile", "whole"),
    Bad("checkpointing-mode", ("trainer.activation_checkpointing=2",), "trainer.activation_checkpointing", "2"),
    Bad("profiler-active", ("profile=true", "profiler.active=0"), "profiler.active", "0"),
    Bad("model-key-typo", ("model.hiden=[256,256]",), "model.hiden", "[256, 256]"),
    Bad("sched-key-without-target", ("sched.step_size=10",), "sched.step_size", "10"),
    Bad("param-groups", ("optim.param_groups=nodecay",), "optim.param_groups", "nodecay"),
    Bad("text-block-size", ("model=gpt", "data.block_size=0"), "data.block_size", "0"),
    Bad("text-val-fraction", ("model=gpt", "data.val_fraction=1"), "data.val_fraction", "1.0"),
    Bad("no-synthetic-samples", ("data=synthetic", "data.num_samples=0"), "data.num_samples", "0"),
    Bad("missing-config-dir", ("--config-dir", "no_such_folder"), "--config-dir", "no_such_folder"),
    Bad("missing-config-name", ("--config-name", "nope"), "--config-name", "nope"),
    Bad("monitor-interval", ("launcher.monitor_interval=-1",), "launcher.monitor_interval", "-1.0"),
    Bad("plus-into-typed-block", ("+trainer.max_step=10",), "trainer.max_step", "10"),
    Bad("plus-at-top-level", ("+foo=bar",), "foo", "bar"),
    Bad("plus-existing-key", ("+trainer.max_steps=10",), "+trainer.max_steps", "10"),
    Bad("name-traversal", ("name=../../escape",), "name", "'../../escape'"),
    Bad("name-only-dots", ("name=..",), "name", ".."),
    Bad("files-without-path", ("data=files",), "data.path", "???"),
    Bad("hf-stream-without-max-steps", ("data=hf", "data.path=rows.jsonl", "data.streaming=true",
        "data.num_features=4", "data.num_classes=2"), "trainer.max_steps", "-1"),
]

BAD_RUNTIME = [
    Bad("nccl-without-gpu", ("backend=nccl",), "backend", "nccl", runtime=True, cpu_only=True),
    Bad("sync-batchnorm-on-cpu", ("strategy=ddp", "strategy.sync_batchnorm=true"), "strategy.sync_batchnorm",
        "True", runtime=True, cpu_only=True),  # torch's SyncBatchNorm is CUDA only (review F8)
    Bad("fp8-without-gpu", ("amp=fp8",), "amp", "fp8", runtime=True, cpu_only=True),
    Bad("world-vs-data", ("trainer.batch_size=5000",), "trainer.batch_size", "5000", runtime=True),
    Bad("world-vs-data-accum", ("trainer.batch_size=400", "trainer.grad_accum=2"), "trainer.batch_size", "400",
        runtime=True),
    Bad("model-target", ("model._target_=no.such.Module",), "model._target_", "no.such.Module", runtime=True),
    Bad("data-target", ("data.train._target_=no.such.fn",), "data.train._target_", "no.such.fn", runtime=True),
    Bad("blocklisted-target", ("model._target_=shutil.rmtree", "+model.path=/nonexistent/disttrain"),
        "model._target_", "shutil.rmtree", runtime=True),
    Bad("model-rejects-value", ("model.activation=swish",), "model", "disttrain.models.mlp.MLP", runtime=True),
    Bad("gpt-tied-pipeline", ("model=gpt", "data=text", "strategy=pipeline"), "model", "disttrain.models.gpt.GPT",
        runtime=True),
    Bad("gpt-heads-vs-tp", ("model=gpt", "data=text", "strategy=tp", "model.n_heads=1", "model.dim=8"),
        "model.n_heads", "1", runtime=True),
    Bad("sweep-one-bad-job", ("-m", "optim.lr=1e-3,-1"), "optim.lr", "-1.0", runtime=True),
    Bad("missing-data-file", ("data=files", "data.path=no_such.npz", "data.num_features=4", "data.num_classes=3"),
        "data.path", "no_such.npz", runtime=True),
    Bad("optim-argument-typo", ("optim.amsgrd=true",), "optim.amsgrd", "True", runtime=True),
    Bad("sched-target-typo", ("sched._target_=torch.optim.lr_scheduler.StepLR", "sched.step_sze=10"),
        "sched.step_sze", "10", runtime=True),
    Bad("empty-csv", ("data=files", "data.path=empty.csv", "data.num_features=2", "data.num_classes=2"),
        "data.path", "empty.csv", runtime=True, files=("empty.csv",)),
    Bad("empty-text", ("model=gpt", "data.path=empty.txt"), "data.path", "empty.txt", runtime=True,
        files=("empty.txt",)),
    Bad("text-block-too-long", ("model=gpt", "data.block_size=100000000"), "data.block_size", "100000000",
        runtime=True),
    Bad("resume-without-checkpoint", ("resume=.",), "resume", ".", runtime=True),  # review D9
    Bad("hf-missing-file", ("data=hf", "data.path=rows.jsonl", "data.num_features=4", "data.num_classes=2"),
        "data.path", "rows.jsonl", runtime=True),
]
# fmt: on


def split_flags(argv: Sequence[str]) -> tuple[list[str], dict[str, Any], bool]:
    """(overrides, `checked` keyword arguments, multirun) from CLI words, for the in-process checks."""
    words, kwargs, multirun = list(argv), {}, False
    for flag, name in (("--config-dir", "config_dir"), ("--config-name", "config_name")):
        if flag in words:
            i = words.index(flag)
            kwargs[name] = words[i + 1]
            del words[i : i + 2]
    if "-m" in words:
        words.remove("-m")
        multirun = True
    return words, kwargs, multirun


class HostReads:
    """Counts reads of a tensor's value back to the host inside a `with` block: `.item()`, `float()`,
    `int()`, `bool()` all run aten._local_scalar_dense, which on CUDA waits for the device (a sync).
    On CPU nothing waits, but the count is the same: a test on CPU proves a GPU step has no sync."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> HostReads:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if func is torch.ops.aten._local_scalar_dense.default:
                    reads.count += 1
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


def installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, package: str, spec: str, module: str
) -> Iterator[tuple[Path, Path]]:
    """A user's strategy package as pip would install it (`strategy.py` + the spec in `__init__.py` +
    an entry point in `disttrain.strategies`) and a config dir holding `strategy/<name>.yaml`."""
    from disttrain.strategies import specs

    site, conf = tmp_path / "site", tmp_path / "conf"
    (site / package).mkdir(parents=True)
    (site / package / "strategy.py").write_text(module)  # one module
    (site / package / "__init__.py").write_text(spec)  # one spec entry ...
    info = site / f"{package}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{specs.ENTRY_POINTS}]\n{name} = {package}\n")  # ... declared
    (conf / "strategy").mkdir(parents=True)
    (conf / "strategy" / f"{name}.yaml").write_text(f"defaults:\n  - base_{name}\n")  # one YAML
    monkeypatch.syspath_prepend(str(site))
    try:
        yield site, conf
    finally:
        specs.unregister(name)
        monkeypatch.delitem(sys.modules, package, raising=False)
        monkeypatch.delitem(sys.modules, f"{package}.strategy", raising=False)


def checkpoint_test_run() -> Run:
    """The fewest blocks a Run needs, with a model, an SGD optimizer and log_every=1: the run whose
    run_info meta.json the checkpoint tests record."""
    return Run.of(
        {
            "name": "t",
            "nodes": 1,
            "nproc_per_node": 1,
            "backend": {},
            "strategy": {"name": "single"},
            "amp": {},
            "launcher": {"name": "spawn"},
            "sched": {"name": "constant"},
            "model": {"hidden": 4},
            "optim": {"_target_": "torch.optim.SGD", "lr": 0.1},
            "trainer": {"log_every": 1},
        }
    )
