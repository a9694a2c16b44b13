"""peft=lora (disttrain/models/adapters.py): LoRA adapters through Hugging Face PEFT, in one process.

A tiny GPT-2 written by save_pretrained is the base (loaded through init.path); a run trains only
the adapters, its checkpoints and final.pt hold them alone, a resume from its middle checkpoint ends
bitwise where it ended, `eval` reads them back, and the exports load with PeftModel.from_pretrained
(the adapter folder) and from_pretrained (the merged model). The 2-rank fsdp run is in
tests/integration/test_lora.py.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from shared_support import LORA_GPT2, lora_gpt2_run, lora_params
from unit_support import ONE_RANK, checked, checked_run, train_in_process

from disttrain.config.errors import ConfigError
from disttrain.config.schema import PeftConfig
from disttrain.models import adapters
from disttrain.rundir import freeze

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.fixture
def tiny(saved_gpt2: Callable[..., Path]) -> Path:
    return saved_gpt2(**LORA_GPT2)


def _meta(build: Any) -> torch.nn.Module:
    with torch.device("meta"):
        model: torch.nn.Module = build()
    return model


def test_default_targets_per_architecture() -> None:
    from disttrain.models.gpt import GPT

    gpt2 = _meta(lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**LORA_GPT2)))
    llama = _meta(lambda: transformers.LlamaForCausalLM(_llama_config()))
    assert adapters.default_targets(gpt2)[0] == ["c_attn", "c_proj", "c_fc"]
    assert adapters.default_targets(llama)[0] == [
        *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    ]
    builtin = _meta(lambda: GPT(vocab_size=32, block_size=8, dim=16, n_layers=2, n_heads=2))
    assert adapters.default_targets(builtin)[0] == ["qkv", "proj", "fc", "fc_out"]

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out, self.norm = (
                torch.nn.Linear(8, 8),
                torch.nn.Linear(8, 8),
                torch.nn.LayerNorm(8),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.inp(self.norm(x)))

    class Net(torch.nn.Module):  # "out" outside the blocks too: short names would reach it
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(2))
            self.out = torch.nn.Linear(8, 2)

    targets, why = adapters.default_targets(Net())
    assert targets == ["layers.0.inp", "layers.0.out", "layers.1.inp", "layers.1.out"], targets
    assert "repeated blocks (2 blocks (Layer))" in why
    with pytest.raises(ConfigError) as exc:  # no blocks, no Linear in them: name them
        adapters.resolve_targets(PeftConfig(name="lora"), torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert exc.value.key == "peft.target_modules" and "peft.target_modules=[0]" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        adapters.resolve_targets(PeftConfig(name="lora", target_modules=["c_attn", "q_proj"]), gpt2)
    assert "q_proj names no module of GPT2LMHeadModel" in str(exc.value)


def _llama_config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )


def test_tiny_llama_adapters_merge_into_the_same_logits() -> None:
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(_llama_config()).eval()
    model = adapters.apply(PeftConfig(name="lora", rank=4), base, announce=False)
    wrapped = [n for n, m in model.named_modules() if n.endswith("lora_A")]
    assert len(wrapped) == 2 * 7  # q, k, v, o, gate, up, down in each layer
    base_params = sum(p.numel() for p in base.parameters() if not p.requires_grad)
    trainable, total = adapters.counts(model)
    assert trainable == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert total == base_params + trainable
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # B starts at 0: move it, or merging proves nothing
        x = torch.arange(24).view(2, 12) % 64
        adapted = model(input_ids=x).logits
        with model.disable_adapter():  # type: ignore[operator]
            plain = model(input_ids=x).logits
        merged = adapters.merged(model)(input_ids=x).logits
    assert not torch.allclose(adapted, plain, atol=1e-4)  # the adapters change the output
    assert torch.allclose(adapted, merged, atol=1e-5, rtol=0)


def test_refused_before_launch() -> None:
    with pytest.raises(ConfigError) as exc:
        checked(["peft=lora", "strategy=tp"])
    assert exc.value.key == "peft" and "strategy=fsdp" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        checked(["peft=lora", "amp=fp8", "amp.fp8_emulate=true", "strategy=fsdp"])
    assert exc.value.key == "amp"
    with pytest.raises(ConfigError) as exc:
        checked(["peft=lora", "peft.rank=0"])
    assert exc.value.key == "peft.rank"  # (a missing peft package: tests/unit/test_extras.py)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


@pytest.mark.usefixtures("one_rank")
def test_lora_trains_adapters_only_resumes_bitwise_and_exports(tiny: Path, tmp_path: Path) -> None:
    """fsdp at world 1 (DTensor parameters, DCP) in this process: the numbers the acceptance asks
    for, a resume from the middle checkpoint that ends bitwise, eval and both exports."""
    run = tmp_path / "run"
    common = (*lora_gpt2_run(tiny), "strategy=fsdp", "trainer.max_steps=4", "trainer.ema.decay=0.5")
    summary = train_in_process(run, *common, "trainer.ckpt_every=2")
    freeze(run, checked_run([*ONE_RANK, *common, "trainer.ckpt_every=2"]), [], [])  # eval, export read it
    lora = lora_params()
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    weights = sum(p.numel() * p.element_size() for p in base.parameters())
    assert summary["peft"] == {
        "trainable_params": lora,
        "total_params": sum(p.numel() for p in base.parameters()) + lora,
        "base_unchanged": True,
    }
    optim = sum(d["optimizer"] for d in summary["state_bytes_detail_by_rank"])
    assert abs(optim - 8 * lora) <= 0.1 * 8 * lora, (optim, lora)  # AdamW's two fp32 moments
    step = run / "checkpoints" / "step_00000004"
    assert _dir_bytes(step) < 0.05 * weights, (_dir_bytes(step), weights)
    from disttrain import checkpoint

    saved = list(checkpoint.dcp_metadata(step).state_dict_metadata)
    ema = [k for k in saved if k.startswith("ema.weights.")]
    assert ema and all("lora_" in k for k in ema), [k for k in ema if "lora_" not in k][:3]
    assert all("lora_" in k for k in saved if k.startswith("model.")), saved[:3]
    final = torch.load(run / "checkpoints" / "final.pt", weights_only=True)["model"]
    assert final and all("lora_" in k for k in final), [k for k in final if "lora_" not in k][:3]
    record = json.loads((run / adapters.BASE_RECORD).read_text())
    assert record["init_path"] == str(tiny) and record["hash"].startswith("xxh3_64:")

    resumed = tmp_path / "resumed"  # the killed run's restart: its newest checkpoint, then on
    train_in_process(resumed, *common, f"resume={run / 'checkpoints' / 'step_00000002'}")
    again = torch.load(resumed / "checkpoints" / "final.pt", weights_only=True)["model"]
    assert again.keys() == final.keys() and all(torch.equal(again[k], final[k]) for k in final)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in final.items() if "lora_B" in k)

    _check_eval(run, tmp_path)
    _check_exports(run, tiny, tmp_path)


def _check_eval(run: Path, tmp_path: Path) -> None:
    """eval's ranks (here: the one in this process) rebuild base + adapters and check the base."""
    from disttrain.config.run import Run
    from disttrain.dist import DistEnv
    from disttrain.eval_worker import evaluate
    from disttrain.rundir import read_config

    job = {
        "mode": "eval",
        "checkpoint": str(run / "checkpoints"),
        "out": str(tmp_path / "eval.json"),
        "base": str(run / adapters.BASE_RECORD),
    }
    env = DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu"))
    result = evaluate(Run.of(read_config(run)), env, job)
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    final_val = [r["val/loss"] for r in logged if "val/loss" in r][-1]
    assert result["step"] == 4 and result["metrics"]["val/loss"] == pytest.approx(final_val, abs=1e-6)
    record = run / adapters.BASE_RECORD
    kept = record.read_text()
    record.write_text(kept.replace('"xxh3_64:', '"xxh3_64:0'))  # another base than the trained one
    with pytest.raises(ConfigError) as exc:
        evaluate(Run.of(read_config(run)), env, job)
    record.write_text(kept)
    assert exc.value.key == "peft" and "the base changed since" in str(exc.value)


def _export(run: Path, *args: str) -> str:
    from disttrain.commands.export import cmd_export

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cmd_export([str(run), *args]) == 0
    return out.getvalue()


def _check_exports(run: Path, tiny: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    said = _export(run, "--format", "hf", "--out", str(tmp_path / "adapter"))
    assert "the adapters" in said and (tmp_path / "adapter" / "adapter_config.json").is_file()
    _export(run, "--format", "hf", "--merge", "--out", str(tmp_path / "merged"))
    x = torch.arange(32).view(2, 16)
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(tiny).eval()
        untouched = base(x).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        with_adapters = adapted(input_ids=x).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        assert torch.allclose(merged(x).logits, with_adapters, atol=1e-5, rtol=0)
    assert not torch.allclose(with_adapters, untouched, atol=1e-4)  # the trained adapters, not zeros
    with pytest.raises(ConfigError) as exc:  # a bare .pt of adapters alone would load into nothing
        _export(run, "--out", str(tmp_path / "model.pt"))
    assert exc.value.key == "--format" and "--merge" in str(exc.value)
