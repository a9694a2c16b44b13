"""Start from weights (`init.path`) and hand the result back (`export --format hf`), through the CLI.

Two sweeps (tests/integration/sweep.py): the source runs (an MLP and a tiny Hugging Face GPT-2
loaded with `from_pretrained`, both under fsdp), then, after `export` wrote the MLP's
`.safetensors` and the GPT-2's `save_pretrained` folder, the runs that start from them and from
the MLP's last DCP checkpoint under ddp and fsdp. A run that starts from weights validates before
its first step (trainer.val_at_start): that loss is the source's final one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import TRANSFORMERS_MODELS, read_yaml, server_preloading, train_records, val_records
from .sweep import Sweep, run_sweep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]  # 2 + 6 sweep jobs

MLP = ("data=synthetic", "trainer.log_every=1")
MLP_STEP = "checkpoints/step_00000004"


def _gpt(root: Path) -> tuple[str, ...]:
    return (
        "data=text",
        "task=model_loss",
        "task.call={input_ids: x, labels: x}",
        "model._target_=transformers.AutoModelForCausalLM.from_pretrained",
        f"model.pretrained_model_name_or_path={root / 'tiny'}",
        "trainer.batch_size=8",
        "trainer.log_every=1",
        # data=text would validate on ~730 windows of 64 (~45 batches of 8 a rank), at the start
        # and the end of each run; 2 a rank, the same in the source and in the run from its
        # weights, compare as well
        "trainer.val_batches=2",
    )


@pytest.fixture(scope="module", autouse=True)
def _transformers_preloaded() -> Iterator[None]:
    """The GPT-2 runs' ranks fork with transformers imported (conftest.server_preloading)."""
    with server_preloading(*TRANSFORMERS_MODELS):
        yield


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's folder: a tiny GPT-2 written by save_pretrained."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("init_export")
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    GPT2LMHeadModel(config).save_pretrained(root / "tiny")
    return root


@pytest.fixture(scope="module")
def sources(root: Path) -> Sweep:
    runs = {
        "mlp": (*MLP, "strategy=fsdp", "trainer.max_steps=4"),
        "gpt": (*_gpt(root), "strategy=fsdp", "trainer.max_steps=2"),
    }
    return run_sweep(root, runs)


@pytest.fixture(scope="module")
def exports(root: Path, sources: Sweep) -> dict[str, str]:
    """`disttrain export` of each source (fsdp runs: their shards gathered into the plain model), in
    this process: the command's own code, without two more interpreter start-ups."""
    import contextlib
    import io

    from disttrain.commands.export import cmd_export

    said = {}
    for name, args in (
        ("mlp", ["--out", str(root / "mlp.safetensors")]),
        ("gpt", ["--format", "hf", "--out", str(root / "gpt_hf")]),
    ):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cmd_export([str(sources[name]), *args]) == 0
        said[name] = out.getvalue()
    return said


@pytest.fixture(scope="module")
def inits(root: Path, sources: Sweep, exports: dict[str, str]) -> Sweep:
    start = ("trainer.val_at_start=true", "trainer.max_steps=1")
    runs = {}
    for strategy in ("ddp", "fsdp"):
        s = (f"strategy={strategy}", *start)
        runs[f"mlp-safetensors-{strategy}"] = (*MLP, *s, f"init.path={root / 'mlp.safetensors'}")
        runs[f"mlp-dcp-{strategy}"] = (*MLP, *s, f"init.path={sources['mlp'] / MLP_STEP}")
        runs[f"gpt-hf-{strategy}"] = (*_gpt(root), *s, f"init.path={root / 'gpt_hf'}")
    return run_sweep(root / "second", runs)


def _final_val(run_dir: Path) -> float:
    loss: float = val_records(run_dir)[-1]["val/loss"]
    return loss


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize(
    ("name", "source"), [("mlp-safetensors", "mlp"), ("mlp-dcp", "mlp"), ("gpt-hf", "gpt")]
)
def test_a_run_from_weights_starts_at_the_source_final_loss(
    sources: Sweep, inits: Sweep, name: str, source: str, strategy: str
) -> None:
    run = f"{name}-{strategy}"
    run_dir = inits[run]
    first = val_records(run_dir)[0]
    assert first["step"] == 0
    assert first["val/loss"] == pytest.approx(_final_val(sources[source]), abs=1e-6)
    assert [r["step"] for r in train_records(run_dir)] == [1]  # a fresh optimizer, schedule and step
    assert "resumed_from" not in read_yaml(run_dir / "summary.json")
    assert read_yaml(run_dir / "config.yaml")["init"]["path"]  # frozen: rerun starts from it too
    log = inits.log(run)
    shards = (
        "each rank read only its own shards"
        if strategy == "fsdp"
        else "each rank read the whole tensors it holds"
    )
    assert "init.path: " in log and shards in log, log[-2000:]
    if strategy == "fsdp":  # the MLP is built on meta; from_pretrained refuses the meta device
        built = (
            "built on the CPU, then sharded: its factory refuses"
            if name == "gpt-hf"
            else "built on the meta device"
        )
        assert built in log, log[-2000:]


def test_export_hf_reloads_with_from_pretrained_and_equal_logits(
    root: Path, sources: Sweep, exports: dict[str, str]
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from .conftest import final_weights

    exported = AutoModelForCausalLM.from_pretrained(root / "gpt_hf").eval()
    trained = AutoModelForCausalLM.from_pretrained(root / "tiny").eval()
    untrained_logits = trained(torch.arange(32).view(2, 16)).logits
    trained.load_state_dict(final_weights(sources["gpt"]))  # what the run's final.pt holds
    x = torch.arange(32).view(2, 16)
    with torch.no_grad():
        assert torch.equal(exported(x).logits, trained(x).logits)
        assert not torch.allclose(exported(x).logits, untrained_logits)  # the trained weights, not the start
    assert exported.config.n_embd == 32 and exported.config.n_layer == 2
    assert "peak RSS" in exports["gpt"] and "peak RSS" in exports["mlp"]


def test_export_hf_of_a_model_without_save_pretrained_is_one_paragraph(root: Path, sources: Sweep) -> None:
    from disttrain.commands.export import cmd_export
    from disttrain.config.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        cmd_export([str(sources["mlp"]), "--format", "hf", "--out", str(root / "no")])
    assert exc.value.key == "--format" and "disttrain.models.mlp.MLP" in str(exc.value)
    assert not (root / "no").exists()
