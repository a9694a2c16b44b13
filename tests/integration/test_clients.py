"""Users' own code trains as written (issue 11): four clients nobody on this project wrote or adapted.

- nanoGPT's `model.py`, vendored byte-identical (tests/clients/nanogpt): `forward(idx, targets)`
  returns `(logits, loss)` -> `task=model_loss 'task.call={idx: x, targets: y}'`;
- a randomly initialised Hugging Face `GPT2LMHeadModel` (dict output, `.loss`, shifts its labels) ->
  `task=model_loss 'task.call={input_ids: x, labels: x}'`;
- a label-smoothing criterion plugged into the classification task by `_target_` arguments;
- a Dataset returning `(x, y, weight)` with the user's own weighted-loss Task.

Each trains under ddp and fsdp on 2 gloo ranks through the CLI; one with amp=bf16, one resumed from
a mid-run checkpoint into a new run with bitwise-equal losses. Losses fall. The runs are the jobs of
one `disttrain train -m` sweep in one user folder (tests/integration/sweep.py: one start-up for all,
each job a complete run with its own run dir); the resume is a run of its own.

fsdp runs with its default units (issue 23): nanoGPT, GPT-2, a Hugging Face BERT and an x-transformers
LM (blocks nested in ModuleLists, which the size policy once handed to `fully_shard` whole) train
with their repeated block as the unit and the losses of ddp; the x-transformers LM also trains under
tp with a plan written in config (`strategy.tp_plan`) for classes nobody here can edit.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest

from .conftest import (
    TRANSFORMERS_MODELS,
    read_yaml,
    run_cli,
    server_preloading,
    train_losses,
    train_records,
    val_records,
    write_module,
)
from .sweep import Sweep, run_sweep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1020)]  # the sweep: 16 x JOB_BUDGET

CLIENTS = Path(__file__).resolve().parents[1] / "clients"

NANOGPT_YAML = """\
# nanoGPT's GPT exactly as its author wrote it; it computes its own loss.
defaults:
  - override /data@_global_.data: text
  - override /task@_global_.task: model_loss
_target_: model.GPT
config:
  _target_: model.GPTConfig
  n_layer: 2
  n_head: 2
  n_embd: 32
  block_size: ${data.block_size}
  vocab_size: ${data.num_classes}
  dropout: 0.0
  bias: true
"""

HF = """\
from transformers import GPT2Config, GPT2LMHeadModel


def tiny_gpt2(n_layer: int = 2, n_embd: int = 32, vocab_size: int = 256, n_positions: int = 64):
    config = GPT2Config(n_layer=n_layer, n_head=2, n_embd=n_embd, vocab_size=vocab_size,
                        n_positions=n_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def tiny_bert(vocab_size: int = 256):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(config)
"""

# The review's x-transformers LM, as its author's README builds it.
XT = """\
from x_transformers import AutoregressiveWrapper, Decoder, TransformerWrapper


def tiny_lm(num_tokens: int = 256, max_seq_len: int = 64):
    decoder = Decoder(dim=64, depth=2, heads=2)
    return AutoregressiveWrapper(TransformerWrapper(num_tokens=num_tokens, max_seq_len=max_seq_len,
                                                    attn_layers=decoder))
"""

WEIGHTED = """\
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from disttrain.data.digits import load_digits
from disttrain.tasks import Classification


class WeightedDigits(Dataset):
    \"\"\"Digits with a per-sample weight: odd labels count twice.\"\"\"

    def __init__(self, split: str = "train"):
        self.base = load_digits(split=split, val_fraction=0.2, seed=0)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x, y, torch.tensor(2.0 if int(y) % 2 else 1.0)


class WeightedDigitsVal(WeightedDigits):
    def __init__(self):
        super().__init__(split="val")


class WeightedCE(Classification):
    \"\"\"Cross-entropy weighted per sample; accuracy on the labels.\"\"\"

    def unpack(self, batch):
        x, y, w = batch
        return x, (y, w)

    def loss(self, output, target):
        y, w = target
        return (F.cross_entropy(output, y, reduction="none") * w).sum() / w.sum()

    def metric_sum(self, output, target):
        return super().metric_sum(output, target[0])

    def count(self, inputs, target):
        return len(target[0])
"""

COMMON = ("trainer.log_every=2", "trainer.val_every=10", "checkpoint.export_final=false")
DIGITS = ("trainer.max_steps=12", "sched=constant", "optim.lr=0.01", *COMMON)
# data=text's validation split is ~1,450 windows of 32: ~90 batches of 8 a rank, 9 times the
# training steps of a 10-step run; two batches a rank show the validation as well
FEW_VAL = "trainer.val_batches=2"
LM = ("data.block_size=32", "trainer.batch_size=8", "trainer.max_steps=10", FEW_VAL, *COMMON)


def _nanogpt(tmp_path: Path) -> Path:
    shutil.copy(CLIENTS / "nanogpt" / "model.py", tmp_path / "model.py")  # the user's repo, as found
    (tmp_path / "conf" / "model").mkdir(parents=True, exist_ok=True)
    (tmp_path / "conf" / "model" / "nanogpt.yaml").write_text(NANOGPT_YAML)
    return tmp_path / "conf"


def _falls(run_dir: Path) -> list[float]:
    losses = train_losses(run_dir)
    assert len(losses) >= 4 and losses[-1] < losses[0] - 0.2, losses
    return losses


# nanoGPT's forward(idx, targets); the tokens per sample are idx's; the loss gives a perplexity.
NANOGPT = ("model=nanogpt", "task.call={idx: x, targets: y}", "task.tokens=idx", "task.perplexity=true")
# The ddp run logs every step and checkpoints at step 5: test_nanogpt_resumes_bitwise continues it.
NANOGPT_DDP = (*NANOGPT, *LM, "strategy=ddp", "trainer.log_every=1", "trainer.ckpt_every=5", "seed=3")


HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_XT = importlib.util.find_spec("x_transformers") is not None
SHORT = (*COMMON, "data.block_size=32", "trainer.batch_size=8", "trainer.max_steps=4", "trainer.log_every=1",
         FEW_VAL)  # fmt: skip
XT_RUN = ("data=text", "task=model_loss", "task.call={x: x}", "model._target_=mylm.tiny_lm", *SHORT)
# x-transformers' attention splits heads with a fixed count (Rearrange h=2): only its MLPs are split.
XT_PLAN = (
    "strategy.tp_plan={net.attn_layers.layers.*.1.ff.0.0: colwise, net.attn_layers.layers.*.1.ff.2: rowwise}"
)
HF_CALL = ("data=text", "task=model_loss", "task.call={input_ids: x, labels: x}")  # HF shifts labels
WEIGHTED_DATA = (
    "data.train._target_=mylab.weighted.WeightedDigits",
    "data.val._target_=mylab.weighted.WeightedDigitsVal",
    "task._target_=mylab.weighted.WeightedCE",
)
# Issue 23: a GPT-2 written by save_pretrained into the sweep's folder (`tiny`, the review's
# GPT2Config), loaded by the user's own from_pretrained call; dropout off through from_pretrained's
# config overrides so that step 1's loss is the saved model's loss on the first global batch.
PRETRAINED_DIR = "tiny"
PRETRAINED = (
    *HF_CALL,
    "model._target_=transformers.AutoModelForCausalLM.from_pretrained",
    f"model.pretrained_model_name_or_path={PRETRAINED_DIR}",
    *(f"+model.{k}=0.0" for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")),
    "data.block_size=32",
    "trainer.batch_size=8",
    "trainer.max_steps=8",
    "trainer.log_every=1",
    "checkpoint.export_final=false",
    FEW_VAL,
)
PRETRAINED_RUNS = {
    "ddp": ("strategy=ddp",),
    "fsdp": ("strategy=fsdp",),
    "fsdp-bf16": ("strategy=fsdp", "amp=bf16"),
}

# The runs of this module that depend on no other: one job each in one sweep (name -> overrides).
RUNS: dict[str, tuple[str, ...]] = {
    "nanogpt-ddp": (*NANOGPT_DDP, "name=full"),
    "nanogpt-fsdp": (*NANOGPT, *LM, "strategy=fsdp", "trainer.log_every=1", "seed=3"),  # ddp's losses
    # The DIGITS run without smoothing, on one rank with the 2 ranks' global batch (2 x 32): its
    # step-1 loss is the same under every strategy (same seed, model and global batch: the parity
    # tests), so one plain run serves both smoothed ones.
    "plain": (
        *DIGITS,
        "strategy=single",
        "nproc_per_node=1",
        "trainer.batch_size=64",
        "seed=1",
        "name=plain",
    ),
    **{
        f"smooth-{s}": (
            *DIGITS,
            f"strategy={s}",
            "seed=1",
            "name=smooth",
            "+task.criterion.label_smoothing=0.2",
        )
        for s in ("fsdp",)  # the criterion is the task's: no strategy sees it (ddp: the same code)
    },
    **{f"weighted-{s}": (*WEIGHTED_DATA, f"strategy={s}", *DIGITS) for s in ("fsdp",)},
    **{
        f"bert-{s}": (*HF_CALL, "model._target_=hfmodels.tiny_bert", f"strategy={s}", *SHORT)
        for s in ("ddp", "fsdp")
        if HAS_TRANSFORMERS
    },
    **{
        f"pretrained-{s}": (*PRETRAINED, *strategy)
        for s, strategy in PRETRAINED_RUNS.items()
        if HAS_TRANSFORMERS
    },
    **{f"xt-{s}": (*XT_RUN, f"strategy={s}") for s in ("ddp", "fsdp") if HAS_XT},
    # tp over the 2 ranks reads ddp's global batch (2 x 8): the same losses, the FeedForwards split
    **({"xt-tp": (*XT_RUN, "strategy=tp", XT_PLAN, "trainer.batch_size=16")} if HAS_XT else {}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """Every run of RUNS as the jobs of one sweep (one parent process and fork server for all), in one
    user folder: nanoGPT's model.py and conf/, the HF model factory, the weighted data and task."""
    cwd = tmp_path_factory.mktemp("clients")
    conf = _nanogpt(cwd)
    write_module(cwd, "hfmodels", HF)
    write_module(cwd, "mylm", XT)
    write_module(cwd, "mylab.weighted", WEIGHTED)
    if HAS_TRANSFORMERS:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2)
        GPT2LMHeadModel(config).save_pretrained(cwd / PRETRAINED_DIR)
    # the ten Hugging Face ranks imported transformers each: ~50 of the sweep's ~165 CPU-s
    with server_preloading(*TRANSFORMERS_MODELS, "x_transformers"):
        return run_sweep(cwd, RUNS, config_dir=conf)


# fsdp under bf16 autocast with an outside model: pretrained-fsdp-bf16 (its step-1 loss, below)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_nanogpt_as_written(strategy: str, runs: Sweep) -> None:
    run_dir = runs[f"nanogpt-{strategy}"]
    _falls(run_dir)
    last = train_records(run_dir)[-1]
    assert last["tokens_per_s"] == pytest.approx(last["samples_per_s"] * 32)  # task.tokens=idx: B x T
    (val,) = val_records(run_dir)
    assert set(val) >= {"val/loss", "val/ppl"} and "val/acc" not in val  # the model gives no metric
    assert read_yaml(run_dir / "config.yaml")["task"]["call"] == {"idx": "x", "targets": "y"}


def test_nanogpt_resumes_bitwise_into_a_new_run(runs: Sweep) -> None:
    cwd, full = runs.cwd, runs["nanogpt-ddp"]
    ckpt = full / "checkpoints" / "step_00000005"
    conf = ("--config-dir", str(cwd / "conf"))
    _, resumed = run_cli(cwd, *NANOGPT_DDP, "name=resumed", f"resume={ckpt}", flags=conf)
    assert resumed is not None
    ref = {r["step"]: r["train/loss"] for r in train_records(full)}
    got = {r["step"]: r["train/loss"] for r in train_records(resumed)}
    assert sorted(got) == list(range(6, 11))
    assert all(got[s] == ref[s] for s in got), (got, ref)  # bitwise, not approximately


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_hugging_face_gpt2(strategy: str, runs: Sweep) -> None:
    pytest.importorskip("transformers")
    _falls(runs[f"pretrained-{strategy}"])  # the loaded GPT-2 trains on (and fsdp wraps it: below)


@pytest.mark.parametrize("strategy", list(PRETRAINED_RUNS))
def test_from_pretrained_trains_the_saved_weights(strategy: str, runs: Sweep) -> None:
    """Issue 23: `model._target_=...from_pretrained` as written (the pre-launch checks used to build
    it on the meta device, which from_pretrained refuses). Step 1's loss is the saved model's own
    loss on the first global batch, so the ranks trained the loaded weights, not a random init."""
    transformers = pytest.importorskip("transformers")
    import torch

    run_dir = runs[f"pretrained-{strategy}"]
    first = train_records(run_dir)[0]
    assert first["step"] == 1
    drop = dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), 0.0)
    saved = transformers.AutoModelForCausalLM.from_pretrained(runs.cwd / PRETRAINED_DIR, **drop)
    x = _first_global_batch(run_dir)
    with torch.no_grad():
        expected = saved(input_ids=x, labels=x).loss.item()
    # fp32: equal (measured 0.0); bf16 autocast rounds activations to 8 mantissa bits (measured 3e-5)
    assert first["train/loss"] == pytest.approx(expected, abs=1e-5 if "bf16" not in strategy else 1e-3)


def _first_global_batch(run_dir: Path) -> Any:
    """Step 1's inputs of both ranks, drawn by the run's own data set and loaders from its frozen config."""
    import torch

    from disttrain.config.run import Run
    from disttrain.data import build_datasets
    from disttrain.data.loaders import make_loaders

    cfg = read_yaml(run_dir / "config.yaml")
    train, _ = build_datasets(cfg["data"])
    run = Run.of(cfg)
    batches = [next(iter(make_loaders(run, None, train, None, (r, 2))[0]))[0] for r in range(2)]  # type: ignore[arg-type]
    return torch.cat(batches)


# client -> (its ddp run, its fsdp run with default settings, the fsdp units the log names)
DEFAULT_UNITS = {
    "nanogpt": ("nanogpt-ddp", "nanogpt-fsdp", "root + 2 wrapped units (Block)"),
    "gpt2": ("pretrained-ddp", "pretrained-fsdp", "root + 2 wrapped units (GPT2Block)"),
    "bert": ("bert-ddp", "bert-fsdp", "root + 2 wrapped units (BertLayer)"),
    "x-transformers": ("xt-ddp", "xt-fsdp", "root + 4 wrapped units (Attention, FeedForward)"),
}


@pytest.mark.parametrize("client", list(DEFAULT_UNITS))
def test_fsdp_default_units_are_the_repeated_blocks_with_ddps_losses(client: str, runs: Sweep) -> None:
    if not (HAS_XT if client == "x-transformers" else HAS_TRANSFORMERS):  # no import: ~3 s
        pytest.skip(f"{client} is not installed")
    ddp, fsdp, units = DEFAULT_UNITS[client]
    assert units in runs.log(fsdp)
    reference, losses = train_losses(runs[ddp]), train_losses(runs[fsdp])
    assert len(losses) >= 4 and losses == pytest.approx(reference, abs=1e-4), (losses, reference)


@pytest.mark.skipif(not HAS_XT, reason="x-transformers is not installed")
def test_tp_plan_from_config_splits_a_class_nobody_here_can_edit(runs: Sweep) -> None:
    log = runs.log("xt-tp")
    assert "plan net.attn_layers.layers.*.1.ff.0.0=ColwiseParallel" in log, log[-2000:]
    assert "net.attn_layers.layers.*.1.ff.2=RowwiseParallel" in log
    losses, reference = train_losses(runs["xt-tp"]), train_losses(runs["xt-ddp"])
    assert len(losses) == 4 and losses == pytest.approx(reference, abs=1e-4), (losses, reference)


@pytest.mark.parametrize("strategy", ["fsdp"])
def test_label_smoothing_criterion(strategy: str, runs: Sweep) -> None:
    smooth = runs[f"smooth-{strategy}"]
    _falls(smooth)
    first_plain, first_smooth = train_losses(runs["plain"])[0], train_losses(smooth)[0]
    # Step 1 sees the same untrained model and batch: smoothing only changes the loss's formula
    # (by more than the <= 2.4e-7 that single, ddp and fsdp differ by, test_strategies_dp).
    assert abs(first_smooth - first_plain) > 1e-5, (first_smooth, first_plain)
    assert read_yaml(smooth / "config.yaml")["task"]["criterion"]["label_smoothing"] == 0.2


@pytest.mark.parametrize("strategy", ["fsdp"])
def test_weighted_three_tuple_dataset_with_a_user_task(strategy: str, runs: Sweep) -> None:
    run_dir = runs[f"weighted-{strategy}"]
    _falls(run_dir)
    val = val_records(run_dir)[-1]
    assert val["step"] == 12 and 0.3 < val["val/acc"] <= 1.0 and val["val/loss"] > 0
