"""amp.master_dtype (review 2026-11-28-gpu G6): a model that arrives in bf16 (transformers >= 5
loads a bf16 checkpoint as bf16) trains with fp32 parameters, AdamW moments and EMA unless the
config asks for a lower dtype; the log says what was cast. Through worker.build_parts, as a rank
builds it, with a tiny GPT-2 saved in bf16 and loaded by `from_pretrained`."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from disttrain.config import compose, resolve
from disttrain.config.run import Run
from disttrain.dist import DistEnv
from disttrain.engine.ema import build_ema
from disttrain.worker import build_parts

ENV = DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu"))


def test_a_bf16_checkpoint_trains_in_fp32_unless_asked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(config).to(torch.bfloat16).save_pretrained(tmp_path / "tinybf16")
    overrides = [
        "data=synthetic",
        "strategy=single",
        "threads_per_rank=1",
        "trainer.ema.decay=0.9",
        "model._target_=transformers.AutoModelForCausalLM.from_pretrained",
        f"model.pretrained_model_name_or_path={tmp_path / 'tinybf16'}",
    ]
    plain = resolve(compose(overrides), overrides)
    dtypes = {}
    for master in ("float32", "bfloat16"):
        plain["amp"]["master_dtype"] = master
        run = Run.of(plain)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="disttrain"):
            _, parts = build_parts(run, ENV)
        for p in parts.model.parameters():
            p.grad = torch.ones_like(p)
        parts.optimizer.step()
        ema = build_ema(run.trainer.ema, parts.model)
        said = [r.getMessage() for r in caplog.records if "amp.master_dtype" in r.getMessage()]
        dtypes[master] = (
            {p.dtype for p in parts.model.parameters()},
            {s["exp_avg"].dtype for s in parts.optimizer.state.values()},
            {w.dtype for w in ema.weights.values()},
            said,
        )
    n = len(list(parts.model.parameters()))  # the tied head once
    assert dtypes["float32"] == (
        {torch.float32},
        {torch.float32},
        {torch.float32},
        [f"amp.master_dtype=float32: {n} parameters in bfloat16 cast to float32 (the trained "
         "parameters, optimizer state and EMA)"],
    )  # fmt: skip
    assert dtypes["bfloat16"] == ({torch.bfloat16}, {torch.bfloat16}, {torch.bfloat16}, [])


def test_frozen_parameters_keep_their_dtype_and_buffers_follow_the_weights() -> None:
    from disttrain.models import to_master_dtype

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.BatchNorm1d(2), torch.nn.Linear(2, 4))
    net[2].weight = net[0].weight  # a tied head
    bf16 = net.to(torch.bfloat16)
    to_master_dtype(bf16, torch.float32, say=False)
    assert {t.dtype for t in bf16.state_dict().values() if t.is_floating_point()} == {torch.float32}
    assert bf16[2].weight is bf16[0].weight  # still tied: one tensor, cast once
    assert bf16[1].num_batches_tracked.dtype == torch.long
    lora = net.to(torch.bfloat16)
    lora[0].weight.requires_grad_(False)  # the frozen base of an adapter: no optimizer state
    to_master_dtype(lora, torch.float32, say=False)
    assert (lora[0].weight.dtype, lora[2].bias.dtype) == (torch.bfloat16, torch.float32)
    assert lora[1].running_mean.dtype == torch.bfloat16  # with the frozen weights, as loaded
