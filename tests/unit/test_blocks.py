"""Per-block activation checkpointing and regional compile (issue 34) for any model: the repeated
blocks FSDP wraps, in this process at world size 1 (gloo over a HashStore).

Compile runs with cheap backends (`trainer.compile_backend`: aot_eager traces forward and backward
like inductor but generates no code; eager only captures): inductor's C++ builds would cost the
suite a minute on two cores. What is checked is the capture: how many graphs, what it costs, and
that training through it gives eager's losses, names and FLOPs.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from unit_support import train_in_process as run
from unit_support import train_records

from disttrain.config.schema import CheckpointMode, CompileMode
from disttrain.models.blocks import checkpoint_blocks, compile_blocks, prepare_blocks
from disttrain.models.gpt import GPT
from disttrain.strategies.fsdp import modules_to_wrap

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_rank")]

GPT4 = ("model=gpt", "data=text", "model.dim=16", "model.n_heads=2", "model.n_layers=4", "data.block_size=16")
SHORT = ("trainer.batch_size=4", "trainer.max_steps=10", "trainer.log_every=1", "trainer.val_batches=1")


def test_switch_fields_read_yaml_booleans_names_and_aliases() -> None:
    assert CompileMode.of("k", True) is CompileMode.true and not CompileMode.of("k", False)
    assert CompileMode.of("k", "regional") is CompileMode.regional
    assert CheckpointMode.of("k", True) is CheckpointMode.full  # `true` kept its meaning
    assert CheckpointMode.of("k", "true") is CheckpointMode.full and not CheckpointMode.of("k", "false")
    assert [m.value for m in CheckpointMode] == ["false", "full", "selective"]  # --help lists these


# ------------------------------------------------------------------------------- regional compile
def test_regional_compile_gives_eager_losses_one_graph_and_the_same_keys(tmp_path: Path) -> None:
    """model=gpt with 4 blocks: one graph for training (and one for validation's no_grad), whatever
    the depth; 10 steps within 1e-4 of eager under single, ddp and fsdp; final.pt keeps the keys."""
    from torch._dynamo.utils import counters

    run(tmp_path / "eager", *GPT4, *SHORT, "strategy=single")
    eager = [r["train/loss"] for r in train_records(tmp_path / "eager")]
    assert len(eager) == 10
    torch._dynamo.reset()
    counters.clear()
    for strategy in ("single", "ddp", "fsdp"):  # ddp reuses single's graph; fsdp's block class is new
        out = tmp_path / strategy
        run(out, *GPT4, *SHORT, f"strategy={strategy}", "trainer.compile=regional",
            "trainer.compile_backend=aot_eager")  # fmt: skip
        losses = [r["train/loss"] for r in train_records(out)]
        assert losses == pytest.approx(eager, abs=1e-4), strategy
        if strategy == "single":
            assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    keys = {
        d: list(torch.load(tmp_path / d / "checkpoints" / "final.pt")["model"])
        for d in ("eager", "single", "fsdp")
    }
    assert keys["single"] == keys["eager"] == keys["fsdp"] and "blocks.0.ln1.weight" in keys["single"]


def test_regional_compile_costs_under_half_of_whole_model_compile() -> None:
    """8 blocks: capturing one block costs less than half of capturing the model (process CPU time,
    a ratio; regional goes first and pays dynamo's one-time warm-up)."""

    def first_step_cpu(regional: bool) -> float:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(vocab_size=64, block_size=8, dim=16, n_layers=8, n_heads=2)
        if regional:
            assert len(compile_blocks(model, "eager")) == 8
        else:
            model.compile(backend="eager")
        start = time.process_time()
        model(torch.randint(0, 64, (2, 8))).sum().backward()
        return time.process_time() - start

    regional, whole = first_step_cpu(True), first_step_cpu(False)
    assert regional <= 0.5 * whole, (regional, whole)


def test_flops_are_counted_under_compile_for_a_hf_gpt2(tmp_path: Path) -> None:
    """Before issue 34 a compiled model other than the built-in gpt had no FLOPs (nor MFU); the first
    step now runs eagerly under the counter. MFU needs a device peak: a CPU has none (no key)."""
    pytest.importorskip("transformers")
    hf = (
        "model._target_=transformers.GPT2LMHeadModel",
        "+model.config={_target_: transformers.GPT2Config, vocab_size: 256, n_positions: 16, n_embd: 16, "
        "n_layer: 2, n_head: 2}",
        "data=text", "data.block_size=16", "task=model_loss", "task.call={input_ids: x, labels: x}",
        "trainer.batch_size=2", "trainer.max_steps=2", "trainer.log_every=1", "trainer.val_batches=1",
        "trainer.count_flops=true", "trainer.compile_backend=eager",
    )  # fmt: skip
    flops = {}
    for mode in ("false", "regional"):
        run(tmp_path / mode, *hf, f"trainer.compile={mode}")
        summary = json.loads((tmp_path / mode / "summary.json").read_text())
        flops[mode] = summary["flops_per_step"]
        assert summary["tflops"] > 0 and "mfu" not in summary
    assert flops["regional"] == flops["false"] > 0


# ------------------------------------------------------------------------ activation checkpointing
def tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=256, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)  # dropout 0.1: recompute must replay the masks


def x_transformers_lm() -> nn.Module:
    xt = pytest.importorskip("x_transformers")
    return xt.TransformerWrapper(
        num_tokens=256, max_seq_len=16, attn_layers=xt.Decoder(dim=32, depth=2, heads=2)
    )


def lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def build(factory: Callable[[], nn.Module], mode: str) -> tuple[nn.Module, list[nn.Module]]:
    torch.manual_seed(0)
    model = factory()
    return model, checkpoint_blocks(model, mode)


class KeptBytes(TorchDispatchMode):
    """Bytes of the storages that ops create while active and that are still alive when asked (after
    forward: what autograd keeps for backward, SAC's saved outputs included, which an outer
    saved_tensors_hooks never sees), leaving out the parameters' (weight views)."""

    def __init__(self, params: set[int]) -> None:
        super().__init__()
        self.params, self.made = params, {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.params:
                storage = t.untyped_storage()
                self.made[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive(self) -> int:
        gc.collect()
        return sum(n for ref, n in self.made.values() if not ref.expired())


@pytest.mark.parametrize("factory", [tiny_gpt2, x_transformers_lm], ids=["hf-gpt2", "x-transformers"])
def test_checkpointing_any_model_under_fsdp_keeps_losses_names_and_saves_memory(
    factory: Callable[[], nn.Module],
) -> None:
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    kept, losses, names = {}, {}, {}
    for mode in ("false", "selective", "full"):
        model, blocks = build(factory, mode)
        names[mode] = ([n for n, _ in model.named_parameters()], list(model.state_dict()))
        assert len(blocks) == (0 if mode == "false" else 4 if factory is x_transformers_lm else 2)
        meter = KeptBytes({p.untyped_storage().data_ptr() for p in model.parameters()})
        with meter:
            loss = lm_loss(model, x)
        kept[mode] = meter.alive()
        del loss
        mesh = init_device_mesh("cpu", (1,))
        for unit in modules_to_wrap(model, set(), 0):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(2)  # dropout's masks: the same stream in every mode
        losses[mode] = []
        for _ in range(4):
            opt.zero_grad()
            loss = lm_loss(model, x)
            loss.backward()
            opt.step()
            losses[mode].append(loss.item())
    assert losses["selective"] == losses["false"] and losses["full"] == losses["false"], losses
    assert names["selective"] == names["false"] == names["full"]
    assert kept["false"] > kept["selective"] > kept["full"], kept


def test_builtin_gpt_goes_through_the_same_path_and_a_flat_model_is_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="disttrain")
    model = GPT(vocab_size=64, block_size=8, dim=16, n_layers=3, n_heads=2)
    prepare_blocks(model, CheckpointMode.full, CompileMode.false, "inductor", announce=True)
    assert "trainer.activation_checkpointing=full: 3 blocks (Block) recompute in backward" in caplog.text
    assert all("forward" in vars(block) for block in model.blocks)
    caplog.clear()
    flat = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8))
    prepare_blocks(flat, CheckpointMode.selective, CompileMode.regional, "inductor", announce=True)
    (line,) = caplog.messages
    assert line.startswith("trainer.activation_checkpointing=selective and trainer.compile=regional: ")
    assert "Sequential has no repeated block" in line and "nothing is applied" in line
