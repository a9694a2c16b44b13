"""The GPU paths, checked without a GPU: torch.cuda mocked to show 0, 1 or 8 devices (issue 27).

What a first run on a CUDA machine meets before any rank starts (nproc_per_node=auto, more nccl
ranks than GPUs, bf16 before Ampere) and inside a rank (per-task GPU binding, the rank's own CUDA
RNG on resume, MFU peaks, TF32, peak GPU memory). In-process: compose + checks, no rank spawned.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
from unit_support import checked_run

from disttrain.config import compose, resolve
from disttrain.config.errors import ConfigError
from disttrain.config.gpus import choose_backend
from disttrain.config.run import Run
from disttrain.dist import DistEnv
from disttrain.preflight.checks import check_runtime
from disttrain.preflight.gpus import check_bf16, check_nccl_ranks

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`gpus(n, name=..., capability=...)`: this process sees n CUDA devices (0: a CPU machine)."""

    def show(count: int, name: str = H100, capability: tuple[int, int] = (9, 0)) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return show


# ------------------------------------------------------------------ #1 nproc_per_node=auto
@pytest.mark.parametrize(("count", "ranks", "backend"), [(0, 2, "gloo"), (1, 1, "nccl"), (8, 8, "nccl")])
def test_auto_is_one_rank_per_gpu_else_two(gpus: Any, count: int, ranks: int, backend: str) -> None:
    gpus(count)
    cfg = resolve(compose([]))
    assert cfg["nproc_per_node"] == ranks and type(cfg["nproc_per_node"]) is int  # frozen as a number
    assert choose_backend(cfg["backend"]["name"]) == backend
    assert check_nccl_ranks(Run.of(cfg)) == count  # the defaults pass on every machine


def test_auto_with_gloo_on_a_gpu_machine_is_two_cpu_ranks(gpus: Any) -> None:
    gpus(8)
    cfg = resolve(compose(["backend=gloo"]))
    assert cfg["nproc_per_node"] == 2
    assert check_nccl_ranks(Run.of(cfg)) == 8


@pytest.mark.parametrize("launcher", ["slurm", "k8s"])
def test_auto_for_a_scheduler_job_is_the_gpus_it_asks_per_node(gpus: Any, launcher: str) -> None:
    """Submitted from a login node without GPUs: the ranks run on the job's nodes."""
    gpus(0)
    cfg = resolve(compose([f"launcher={launcher}", "launcher.gpus_per_node=4"]))
    assert cfg["nproc_per_node"] == 4
    assert resolve(compose([f"launcher={launcher}"]))["nproc_per_node"] == 2  # no GPU asked for


@pytest.mark.parametrize(("count", "nproc"), [(1, 2), (8, 16)])
def test_more_ranks_than_gpus_with_auto_backend_is_refused_before_launch(
    gpus: Any, count: int, nproc: int
) -> None:
    """backend=auto becomes nccl in the ranks: rank `count` would die with "invalid device ordinal"."""
    gpus(count)
    cfg = checked_run([f"nproc_per_node={nproc}"])
    assert cfg.backend.name == "auto"
    with pytest.raises(ConfigError) as err:
        check_runtime(cfg)
    assert err.value.key == "nproc_per_node" and err.value.value == nproc
    assert f"<= {count} " in err.value.allowed and "nccl" in err.value.allowed
    assert f"nproc_per_node={count}" in err.value.hint and "backend=gloo" in err.value.hint


def test_bench_comm_refuses_more_ranks_than_gpus_with_auto_backend(gpus: Any) -> None:
    from disttrain.tools.benchcmd import compose_checked, parser

    gpus(1)
    with pytest.raises(ConfigError) as err:
        compose_checked(parser().parse_intermixed_args(["comm", "nproc_per_node=2"]))
    assert err.value.key == "nproc_per_node" and "<= 1 " in err.value.allowed


def test_nproc_per_node_takes_auto_or_a_positive_integer() -> None:
    for bad in ("abc", "0", "-1"):
        with pytest.raises(ConfigError) as err:
            resolve(compose([f"nproc_per_node={bad}"]))
        assert err.value.key == "nproc_per_node" and "auto" in err.value.allowed


# ------------------------------------------------------------------ #2 per-task GPU binding
def _rank_env(monkeypatch: pytest.MonkeyPatch, local_rank: int, local_world: int) -> list[Any]:
    for key, value in {
        "RANK": local_rank,
        "LOCAL_RANK": local_rank,
        "WORLD_SIZE": local_world,
        "LOCAL_WORLD_SIZE": local_world,
    }.items():
        monkeypatch.setenv(key, str(value))
    chosen: list[Any] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


@pytest.mark.parametrize(("count", "local_rank", "index"), [(8, 3, 3), (1, 3, 0), (2, 3, 1)])
def test_rank_device_is_its_local_rank_or_its_own_bound_gpu(
    gpus: Any, monkeypatch: pytest.MonkeyPatch, count: int, local_rank: int, index: int
) -> None:
    """srun --gpus-per-task=1: each of 4 tasks sees one device, cuda:0 (2 per task: cuda:0, cuda:1)."""
    gpus(count)
    chosen = _rank_env(monkeypatch, local_rank, 4)
    env = DistEnv.from_env("auto")
    assert env.backend == "nccl" and env.device == torch.device("cuda", index)
    assert chosen == [torch.device("cuda", index)]


def test_more_local_ranks_than_gpus_without_binding_is_a_clear_error(
    gpus: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus(3)  # 4 local ranks over 3 devices: no even per-task binding explains it
    chosen = _rank_env(monkeypatch, 3, 4)
    with pytest.raises(ConfigError) as err:
        DistEnv.from_env("nccl")
    assert (
        err.value.key == "LOCAL_RANK" and "< 3 " in err.value.allowed and "4 local rank" in err.value.allowed
    )
    assert chosen == []


def test_ranks_bound_one_gpu_per_task_pass_the_rank_count_check(
    gpus: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`srun ... disttrain train`: 8 launched ranks on a node, each seeing its own single GPU."""
    gpus(1)
    _rank_env(monkeypatch, 3, 8)
    cfg = resolve(compose(["nproc_per_node=8"]))
    assert check_nccl_ranks(Run.of(cfg)) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    gpus(3)  # 8 ranks over 3 visible GPUs each: not a per-task binding
    with pytest.raises(ConfigError):
        check_nccl_ranks(Run.of(cfg))


# ------------------------------------------------------------------ #9 the rank's own CUDA RNG
def test_rng_saves_only_the_ranks_own_device(gpus: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from disttrain import rng

    gpus(8)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([device.index]))

    def every_device() -> list[torch.Tensor]:
        raise AssertionError("get_rng_state_all: one state per visible device")

    monkeypatch.setattr(torch.cuda, "get_rng_state_all", every_device)
    state = rng.rng_state(torch.device("cuda", 5))
    assert torch.equal(state["cuda"], torch.tensor([5]))
    assert "cuda" not in rng.rng_state(torch.device("cpu"))


@pytest.mark.parametrize(
    ("saved", "device", "restored"),
    [
        ([torch.tensor([i]) for i in range(8)], 3, [3]),  # old checkpoint: 8 devices' states, 4 visible now
        ([torch.tensor([i]) for i in range(8)], 0, [0]),
        ([torch.tensor([0])], 3, []),  # saved where this device did not exist: nothing of its own
        (torch.tensor([7]), 3, [7]),  # new checkpoint: the rank's own state only
    ],
)
def test_resume_restores_the_ranks_own_cuda_rng_with_fewer_visible_gpus(
    gpus: Any, monkeypatch: pytest.MonkeyPatch, saved: Any, device: int, restored: list[int]
) -> None:
    from disttrain import rng

    gpus(4)
    calls: list[tuple[int, torch.device]] = []
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device="cuda": calls.append((int(state[0]), device))
    )
    state = {**rng.rng_state(), "cuda": saved}
    rng.set_rng_state(state, torch.device("cuda", device))
    assert calls == [(r, torch.device("cuda", device)) for r in restored]


# ------------------------------------------------------------------ #12 MFU peaks
@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H100 80GB HBM3", 989),  # SXM5
        ("NVIDIA GH200 480GB", 989),
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", None),  # a variant the table does not know: no guess
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100-PCIE-40GB", 312),
        ("NVIDIA L40", 181),
        ("NVIDIA L40S", 362),
        ("NVIDIA L4", 121),
        ("NVIDIA A10G", 125),
        ("Tesla V100-SXM2-16GB", 125),
        ("Tesla T4", 65),
        ("NVIDIA GeForce RTX 4090", 165),
        ("NVIDIA B200", None),
    ],
)
def test_peak_flops_match_the_device_name_by_words(gpus: Any, name: str, tflops: int | None) -> None:
    from disttrain.observe.throughput import device_peak_flops

    gpus(1, name=name)
    peak = device_peak_flops(torch.device("cuda", 0))
    assert (peak / 1e12 if peak else None) == tflops


def test_mfu_divides_by_the_gpus_a_rank_drives_and_fp32_uses_the_tf32_peak(gpus: Any) -> None:
    from disttrain.observe.throughput import Throughput, device_peak_flops

    gpus(8, name="NVIDIA A100-SXM4-80GB", capability=(8, 0))
    cuda = torch.device("cuda", 0)
    model = type("M", (), {"flops_per_token": lambda self: 1e6})()
    env = DistEnv(0, 0, 1, 1, "nccl", cuda)
    one, dp = Throughput(model, env), Throughput(model, env, gpus_per_rank=8)  # dp: 1 rank, 8 GPUs
    rate_one, rate_dp = one.rates(312_000_000, 1.0, 1)["mfu"], dp.rates(312_000_000, 1.0, 1)["mfu"]
    assert rate_one == pytest.approx(1.0) and rate_dp == pytest.approx(1 / 8)  # 312 TFLOP/s done
    assert device_peak_flops(cuda, amp="off") == 156e12  # TF32 tensor cores: half the bf16 peak
    assert device_peak_flops(cuda, amp="off", tf32=False) is None  # full fp32: MFU n/a
    assert "mfu" not in Throughput(model, env, amp="off", tf32=False).rates(1000, 1.0, 1)
    gpus(1, name="Tesla V100-SXM2-16GB", capability=(7, 0))
    assert device_peak_flops(cuda, amp="off") is None  # no TF32 before Ampere
    assert device_peak_flops(cuda, amp="fp16") == 125e12


# ------------------------------------------------------------------ #15 TF32, bf16 before Ampere
@pytest.mark.parametrize(
    ("tf32", "device", "calls"), [(True, "cuda", ["high"]), (False, "cuda", ["highest"]), (True, "cpu", [])]
)
def test_tf32_matmuls_on_cuda_by_default_with_a_switch(
    monkeypatch: pytest.MonkeyPatch, tf32: bool, device: str, calls: list[str]
) -> None:
    from disttrain.strategies.precision import Precision

    seen: list[str] = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", seen.append)
    Precision({"name": "off", "dtype": "float32", "tf32": tf32}, torch.device(device))
    assert seen == calls
    assert resolve(compose([]))["amp"]["tf32"] is True  # the schema's default


def test_bf16_before_ampere_is_refused_before_launch(gpus: Any) -> None:
    gpus(1, name="Tesla V100-SXM2-16GB", capability=(7, 0))
    cfg = checked_run(["amp=bf16", "nproc_per_node=1"])
    with pytest.raises(ConfigError) as err:
        check_runtime(cfg)
    assert err.value.key == "amp" and err.value.value == "bf16"
    assert "7.0" in err.value.allowed and "V100" in err.value.allowed
    assert "amp=fp16" in err.value.hint and "amp.bf16_emulation=true" in err.value.hint


def test_bf16_before_ampere_warns_when_emulation_is_allowed(
    gpus: Any, caplog: pytest.LogCaptureFixture
) -> None:
    gpus(1, name="Tesla T4", capability=(7, 5))
    cfg = Run.of(resolve(compose(["amp=bf16", "amp.bf16_emulation=true"])))
    with caplog.at_level(logging.WARNING, logger="disttrain"):
        check_bf16(cfg, 1)
    assert "runs emulated" in caplog.text and "7.5" in caplog.text
    gpus(1, capability=(8, 0))
    check_bf16(Run.of(resolve(compose(["amp=bf16"]))), 1)  # Ampere and newer: native bf16
    gpus(0)
    check_bf16(Run.of(resolve(compose(["amp=bf16"]))), 0)  # CPU ranks: bf16 autocast on the CPU


# ------------------------------------------------------------------ #17 peak GPU memory
def test_peak_gpu_memory_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from disttrain.observe import gpu_memory

    resets: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 5 * 2**29)
    cuda, cpu = (
        DistEnv(0, 0, 1, 1, "nccl", torch.device("cuda", 0)),
        DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu")),
    )
    gpu_memory.reset_peaks(cuda)
    gpu_memory.reset_peaks(cpu)
    assert resets == [torch.device("cuda", 0)]
    assert gpu_memory.peaks(cuda) == {"gpu_mem_allocated_peak_gib": 3.0, "gpu_mem_reserved_peak_gib": 2.5}
    assert gpu_memory.peaks(cpu) == {}


def test_the_one_line_summary_shows_gpu_memory_only_when_recorded(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from disttrain.observe.summary import print_done as print_summary

    base = {"steps": 4, "samples_per_s": 100.0, "train_time_s": 2.0, "val/loss": 0.5}
    (tmp_path / "summary.json").write_text(json.dumps(base))
    print_summary(tmp_path)
    cpu_line = capsys.readouterr().out
    assert (
        cpu_line == f"done: 4 steps, val/loss=0.5000, 100 samples/s, 2.0 s training | run dir: {tmp_path}\n"
    )
    gpu = {**base, "gpu_mem_allocated_peak_gib": 3.0, "gpu_mem_reserved_peak_gib": 3.5}
    (tmp_path / "summary.json").write_text(json.dumps(gpu))
    print_summary(tmp_path)
    assert ", peak GPU memory 3.00 GiB (3.50 reserved) | run dir" in capsys.readouterr().out
