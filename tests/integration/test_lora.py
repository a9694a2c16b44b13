"""peft=lora under fsdp on 2 ranks, through the CLI: what only crosses processes.

One run of a tiny GPT-2 (save_pretrained, loaded by init.path) whose LoRA adapters and frozen base
are sharded over two ranks: neither rank's frozen shards change by a bit, the AdamW state summed
over the ranks is the adapters' two moments, and the checkpoint both ranks wrote is under 5 % of
the model's weights. A second run from its step-2 checkpoint (what a kill after that save leaves)
trains steps 3-4 bitwise as the first did, on two ranks. One process covers the rest (eval,
exports: tests/unit/test_peft_lora.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from shared_support import LORA_GPT2, lora_gpt2_run, lora_params

from .conftest import final_weights, run_cli, train_records

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_lora_under_fsdp_on_two_ranks(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**LORA_GPT2)).save_pretrained(tmp_path / "tiny")
    tiny = tmp_path / "tiny"
    run = (
        *lora_gpt2_run(tiny),
        "strategy=fsdp",
        "trainer.max_steps=4",
        "trainer.ckpt_every=2",
        "trainer.log_every=1",
    )
    _, run_dir = run_cli(tmp_path, *run, timeout=240)
    assert run_dir is not None
    summary = json.loads((run_dir / "summary.json").read_text())
    lora = lora_params()
    weights = sum(p.numel() * 4 for p in transformers.AutoModelForCausalLM.from_pretrained(tiny).parameters())
    assert summary["peft"]["trainable_params"] == lora
    assert summary["peft"]["base_unchanged"] is True  # every rank's frozen shards, bit for bit
    per_rank = summary["state_bytes_detail_by_rank"]
    assert len(per_rank) == 2 and all(r["optimizer"] > 0 for r in per_rank)  # the adapters are sharded
    optim = sum(r["optimizer"] for r in per_rank)
    assert abs(optim - 8 * lora) <= 0.1 * 8 * lora, (optim, lora)
    step = run_dir / "checkpoints" / "step_00000004"
    written = sum(f.stat().st_size for f in step.iterdir() if f.is_file())
    assert written < 0.05 * weights, (written, weights)
    final = final_weights(run_dir)
    assert sum(v.numel() for v in final.values()) == lora and all("lora_" in k for k in final)
    record = json.loads((run_dir / "peft_base.json").read_text())
    assert record["init_path"] == str(tiny)
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert f"{lora:,} of {summary['peft']['total_params']:,} parameters train" in log, log[-2000:]

    # Resumed on two ranks from the step-2 checkpoint into a new run: steps 3-4 and the adapters
    # come out bit for bit as the uninterrupted run's.
    mid = run_dir / "checkpoints" / "step_00000002"
    _, resumed = run_cli(tmp_path, *run, "name=resumed", f"resume={mid}", timeout=240)
    assert resumed is not None
    ref = {r["step"]: r["train/loss"] for r in train_records(run_dir)}
    got = {r["step"]: r["train/loss"] for r in train_records(resumed)}
    assert sorted(got) == [3, 4] and all(got[s] == ref[s] for s in got), (got, ref)
    again = final_weights(resumed)
    assert again.keys() == final.keys() and all(torch.equal(again[k], final[k]) for k in final)
