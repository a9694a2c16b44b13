"""trainer.ema and the counted FLOPs, in this process at world size 1 (gloo over a HashStore).

FSDP at one rank is the DTensor path itself: the parameters are DTensors on a one-rank mesh and
the EMA holds DTensors beside them, saved and loaded through DCP as a 2-rank run's are. The
reference is torch's own `AveragedModel` EMA of a plain single-process run fed the same batches.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from unit_support import checked

from disttrain import checkpoint
from disttrain.commands.export import export
from disttrain.config.errors import ConfigError
from disttrain.config.run import Run
from disttrain.dist import DistEnv
from disttrain.engine import loop
from disttrain.observe.metrics import read_metrics
from disttrain.worker import train

pytestmark = pytest.mark.timeout(240)

ONE = ("nproc_per_node=1", "trainer.progress=false", "threads_per_rank=1", "observe.sinks=[]")
SMALL = ("data=synthetic", "model.hidden=[32,32]", "trainer.max_steps=20", "trainer.val_every=10")
DECAY = 0.9


def run(run_dir: Path, *overrides: str) -> dict[str, Any]:
    """worker.train of the checked config into `run_dir`, with its config.yaml as the parent writes it."""
    cfg = checked([*ONE, *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml")
    return train(Run.of(cfg), DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu")), run_dir)


def exported(run_dir: Path, ema: bool) -> dict[str, torch.Tensor]:
    """The plain model's state dict as `disttrain export RUN_DIR [--ema]` writes it."""
    out = run_dir / ("ema.pt" if ema else "raw.pt")
    assert export(run_dir, run_dir, out, ema=ema) == 0
    return dict(torch.load(out, weights_only=True))


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> list[loop.Engine]:
    """Every Engine that fits in this test, kept for a look at its EMA."""
    seen: list[loop.Engine] = []
    fit = loop.Engine.fit

    def keep(self: loop.Engine) -> dict[str, Any]:
        seen.append(self)
        return fit(self)

    monkeypatch.setattr(loop.Engine, "fit", keep)
    return seen


def test_ema_under_fsdp_equals_averaged_model_and_resumes_bitwise(
    tmp_path: Path, one_rank: None, engines: list[loop.Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    ema = (f"trainer.ema.decay={DECAY}", "trainer.ckpt_every=10", "checkpoint.async=true")
    summary = run(tmp_path / "fsdp", *SMALL, "strategy=fsdp", *ema)
    (fsdp,) = engines
    from torch.distributed.tensor import DTensor

    assert all(isinstance(w, DTensor) for w in fsdp.ema.weights.values()), "sharded like the params"
    ema_weights = exported(tmp_path / "fsdp", ema=True)
    raw = exported(tmp_path / "fsdp", ema=False)

    # The reference: torch's AveragedModel EMA of a single-process run, updated after each step.
    ref: list[AveragedModel] = []
    step = loop.Engine.train_step

    def step_and_average(self: loop.Engine, micro_batches: list[Any]) -> Any:
        out = step(self, micro_batches)
        if not ref:
            ref.append(AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True))
        ref[0].update_parameters(self.model)
        return out

    monkeypatch.setattr(loop.Engine, "train_step", step_and_average)
    run(tmp_path / "single", *SMALL, "strategy=single")
    averaged = ref[0].module.state_dict()
    assert sorted(averaged) == sorted(ema_weights)
    for name, value in averaged.items():
        torch.testing.assert_close(ema_weights[name], value, rtol=0, atol=1e-6)
    assert max((ema_weights[k] - raw[k]).abs().max().item() for k in raw) > 1e-3, "EMA != weights"

    # val_ema/* is the validation of those weights: the single run's model, given them, agrees.
    single = engines[1]
    with torch.no_grad():
        for name, p in single.model.state_dict(keep_vars=True).items():
            p.copy_(averaged[name])
    assert summary["val_ema/loss"] == pytest.approx(
        loop.validation(single.strategy, single.model, single.task, single.val_loader, single.env.device)[
            "val/loss"
        ],
        abs=1e-6,
    )
    assert summary["val_ema/loss"] != summary["val/loss"]
    records = [r for r in read_metrics(tmp_path / "fsdp") if "val_ema/loss" in r]
    assert [r["step"] for r in records] == [10, 20] and all("val/acc" in r for r in records)

    # `disttrain eval --ema` of the run (its rank code, in this process) gives the same val_ema/loss.
    from disttrain.eval_worker import evaluate

    cfg = checked([*ONE, *SMALL, "strategy=fsdp", *ema])
    env = DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu"))
    for weights, key in ((True, "val_ema/loss"), (False, "val/loss")):
        job = {
            "mode": "eval",
            "checkpoint": str(tmp_path / "fsdp" / "checkpoints"),
            "out": str(tmp_path / "e.json"),
        }
        result = evaluate(Run.of(cfg), env, {**job, "ema": weights})
        assert result["metrics"]["val/loss"] == pytest.approx(summary[key], abs=1e-6), key

    # Resumed from the step-10 checkpoint (as after a kill -9 there): the same EMA, bit for bit.
    monkeypatch.setattr(loop.Engine, "train_step", step)
    step10 = tmp_path / "fsdp" / "checkpoints" / checkpoint.step_name(10)
    resumed = run(tmp_path / "resumed", *SMALL, "strategy=fsdp", *ema, f"resume={step10}")
    assert resumed["resumed_from"] == str(step10)
    again = exported(tmp_path / "resumed", ema=True)
    assert all(torch.equal(again[k], v) for k, v in ema_weights.items())
    assert resumed["val_ema/loss"] == summary["val_ema/loss"]


def test_ema_every_and_start_step_follow_the_rule(one_rank: None, tmp_path: Path) -> None:
    """every=3, start_step=5: updates at steps 6, 9; the first copies the weights."""
    from disttrain.config.schema import EmaConfig
    from disttrain.engine.ema import EMA

    model = torch.nn.Linear(2, 1)
    ema = EMA(EmaConfig(decay=0.5, every=3, start_step=5), model)
    seen = []
    for step in range(1, 11):
        with torch.no_grad():
            model.weight.fill_(float(step))
        ema.update(step)
        seen.append(ema.weights["weight"][0, 0].item())
    assert len(set(seen[:5])) == 1, "before start_step: the initial copy, untouched"
    assert seen[5:] == [6.0, 6.0, 6.0, 7.5, 7.5], seen
    assert ema.updates == 2


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("trainer.ema.decay=1.5",), "trainer.ema.decay"),
        (("trainer.ema.decay=0.99", "trainer.ema.every=0"), "trainer.ema.every"),
        (("trainer.ema.decay=0.99", "strategy=pipeline", "nproc_per_node=2"), "trainer.ema.decay"),
    ],
)
def test_ema_config_mistakes_are_one_paragraph(overrides: tuple[str, ...], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        checked(["data=synthetic", *overrides])
    assert info.value.key == key


def test_export_ema_of_a_run_without_ema_names_the_flag(tmp_path: Path, one_rank: None) -> None:
    run(tmp_path, "data=synthetic", "model.hidden=[8]", "trainer.max_steps=2", "strategy=single")

    with pytest.raises(ConfigError) as info:
        export(tmp_path, tmp_path, tmp_path / "m.pt", ema=True)
    assert info.value.key == "--ema" and "trainer.ema.decay" in str(info.value)
    assert not (tmp_path / "m.pt").exists()
    from disttrain.commands.evaluate import _check_checkpoint

    with pytest.raises(ConfigError) as info:  # eval/predict --ema: refused before any rank starts
        _check_checkpoint(tmp_path / "checkpoints", str(tmp_path), ema=True)
    assert info.value.key == "--ema"


def mlp_flops(batch: int, widths: list[int]) -> int:
    """Hand count of one step of an MLP: forward 2*B*in*out per Linear, backward twice that except
    the first layer's input gradient (the data needs none)."""
    layers = list(itertools.pairwise(widths))
    forward = sum(2 * batch * a * b for a, b in layers)
    return forward + 2 * forward - 2 * batch * layers[0][0] * layers[0][1]


def test_counted_flops_and_mfu_of_the_mlp_equal_a_hand_count(
    tmp_path: Path, one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The built-in mlp on synthetic data (32 features, 4 classes): FLOPs per step counted on the first
    step; MFU against a stand-in peak of 1 TFLOP/s (a CPU has none: no mfu without it)."""
    from disttrain.observe import throughput

    common = ("data=synthetic", "model.hidden=[64,32]", "trainer.log_every=2", "trainer.max_steps=6")
    run(tmp_path / "off", *common, "strategy=ddp")
    assert not any("flops_per_step" in r for r in read_metrics(tmp_path / "off"))  # CPU: no peak, no count
    common = (*common, "trainer.count_flops=true")
    run(tmp_path / "cpu", *common, "strategy=ddp", "trainer.grad_accum=2", "trainer.batch_size=8")
    cfg = checked([*ONE, "data=synthetic"])
    hand = mlp_flops(16, [cfg["data"]["num_features"], 64, 32, cfg["data"]["num_classes"]])
    records = [r for r in read_metrics(tmp_path / "cpu") if "train/loss" in r]
    assert len(records) == 3
    for r in records:
        assert r["flops_per_step"] == pytest.approx(hand, rel=1e-2) and "mfu" not in r
        assert r["tflops"] == pytest.approx(hand / r["step_time_s"] / 1e12, rel=1e-6)

    monkeypatch.setattr(throughput, "device_peak_flops", lambda *a, **k: 1e12)
    summary = run(tmp_path / "peak", *common, "strategy=fsdp", "trainer.batch_size=16")
    last = [r for r in read_metrics(tmp_path / "peak") if "train/loss" in r][-1]
    assert last["flops_per_step"] == pytest.approx(hand, rel=1e-2)
    assert last["mfu"] == pytest.approx(hand / last["step_time_s"] / 1e12, rel=1e-2)
    assert summary["mfu"] == last["mfu"] and summary["tflops"] == last["tflops"]


@pytest.mark.parametrize("strategy", ["zero2", "ddp"])
def test_ema_never_changes_training(tmp_path: Path, one_rank: None, strategy: str) -> None:
    """Validating the EMA swaps its weights in and back: the training losses and final weights are
    those of the same run without EMA. zero2 keeps full parameters after a forward: they must be
    dropped around the swap, or the next step trains on the EMA weights."""
    common = ("data=synthetic", "model.hidden=[16]", "trainer.max_steps=8", "trainer.log_every=1")
    losses = []
    for name, ema in (("plain", "trainer.ema.decay=null"), ("ema", "trainer.ema.decay=0.5")):
        run(tmp_path / name, *common, f"strategy={strategy}", "trainer.val_every=2", ema)
        losses.append([r["train/loss"] for r in read_metrics(tmp_path / name) if "train/loss" in r])
    assert len(losses[0]) == 8 and losses[0] == losses[1]
    vals = [r for r in read_metrics(tmp_path / "ema") if "val_ema/loss" in r]
    assert len(vals) == 4 and all(r["val_ema/loss"] != r["val/loss"] for r in vals), "the EMA's own forward"


def test_export_ema_keeps_tied_weights_averaged(tmp_path: Path, one_rank: None) -> None:
    """gpt ties the head to the token embedding: the EMA holds that tensor once (as the embedding),
    and the export writes the average under both names, not the trained head over it."""
    from shared_support import TINY_GPT

    # one validation batch: the whole text split is ~180 batches of 8, twice (the model and its EMA)
    run(tmp_path, *TINY_GPT, "strategy=single", "trainer.max_steps=3", "trainer.ema.decay=0.5",
        "trainer.batch_size=8", "trainer.val_batches=1")  # fmt: skip
    ema, raw = exported(tmp_path, ema=True), exported(tmp_path, ema=False)
    tok, head = "embed.tok.weight", "head.out.weight"
    assert torch.equal(ema[tok], ema[head]) and torch.equal(raw[tok], raw[head])
    assert not torch.equal(ema[head], raw[head]), "the head is the averaged embedding"
