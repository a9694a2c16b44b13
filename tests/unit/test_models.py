"""disttrain.models and disttrain.data: the built-in models split as documented; data sets and tasks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from disttrain.data.files import load_files
from disttrain.data.text import DEFAULT_FILE, load_text
from disttrain.models.blocks import checkpoint_blocks
from disttrain.models.cnn import CNN
from disttrain.models.gpt import GPT, Attention, fuse_qkv
from disttrain.models.parallel import pipeline_layers, shared_across_layers, tp_plan_fn
from disttrain.tasks import Classification, LanguageModel


def _gpt(**kw: object) -> GPT:
    torch.manual_seed(0)
    return GPT(**{"vocab_size": 256, "block_size": 16, "dim": 32, "n_layers": 2, "n_heads": 4, **kw})  # type: ignore[arg-type]


def test_gpt_shapes_tied_head_and_pipeline_layers_compose_to_forward() -> None:
    model = _gpt(tie_weights=False).eval()
    idx = torch.randint(0, 256, (3, 16))
    out = model(idx)
    assert out.shape == (3, 16, 256)
    x = idx
    layers = pipeline_layers(model)
    assert layers is not None and [n for n, _ in layers] == ["embed", "blocks.0", "blocks.1", "head"]
    for _, layer in layers:
        x = layer(x)
    torch.testing.assert_close(x, out)
    assert shared_across_layers(layers) == []
    tied = _gpt()
    assert tied.head.out.weight is tied.embed.tok.weight
    assert shared_across_layers(pipeline_layers(tied) or []), "tied weights are reported for pipeline"


def test_gpt_is_causal() -> None:
    model = _gpt().eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 256
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gpt_tp_plan_is_registered_and_names_real_modules() -> None:
    model = _gpt()
    factory = tp_plan_fn(model)
    assert factory is not None
    plan = factory()
    modules = {n for n, _ in model.named_modules()}
    assert set(plan) <= modules and len(plan) == 4 * 2
    assert type(plan["blocks.0.attn.qkv"]).__name__ == "ColwiseParallel"
    assert type(plan["blocks.1.fc_out"]).__name__ == "RowwiseParallel"
    assert model.flops_per_token() > 6 * 32 * 32


def test_fused_qkv_is_the_separate_projections_and_a_tp_shard_holds_whole_heads() -> None:
    """attn.qkv's rows are ordered (heads, 3, head_dim): a state dict with separate q, k and v
    (before the fusion) converts with fuse_qkv to the same attention; and each tensor-parallel
    rank's contiguous block of rows (ColwiseParallel's Shard(0)), with its columns of proj
    (RowwiseParallel), computes its heads' share: the shares sum to the whole output."""
    torch.manual_seed(0)
    dim, heads, tp = 16, 4, 2
    x = torch.randn(2, 5, dim)
    old = {f"attn.{n}.{leaf}": torch.randn(dim, dim) if leaf == "weight" else torch.randn(dim)
           for n in ("q", "k", "v", "proj") for leaf in ("weight", "bias")}  # fmt: skip
    q, k, v = (
        (x @ old[f"attn.{n}.weight"].T + old[f"attn.{n}.bias"]).view(2, 5, heads, -1).transpose(1, 2)
        for n in ("q", "k", "v")
    )
    y = (
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        .transpose(1, 2)
        .reshape(2, 5, dim)
    )
    expected = y @ old["attn.proj.weight"].T + old["attn.proj.bias"]
    attn = Attention(dim, heads, dropout=0.0)
    fused = {key.removeprefix("attn."): t for key, t in fuse_qkv(old, heads).items()}
    attn.load_state_dict(fused)  # strict: exactly qkv and proj
    torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-5)
    shares = []
    for rank in range(tp):
        local = Attention(dim, heads, dropout=0.0)  # its forward reshapes with -1 heads
        rows, cols = 3 * dim // tp, dim // tp
        local.qkv = nn.Linear(dim, rows)
        local.proj = nn.Linear(cols, dim, bias=False)
        with torch.no_grad():
            local.qkv.weight.copy_(fused["qkv.weight"][rank * rows : (rank + 1) * rows])
            local.qkv.bias.copy_(fused["qkv.bias"][rank * rows : (rank + 1) * rows])
            local.proj.weight.copy_(fused["proj.weight"][:, rank * cols : (rank + 1) * cols])
        shares.append(local(x))
    torch.testing.assert_close(sum(shares) + fused["proj.bias"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", [lambda: _gpt(dropout=0.0), lambda: CNN(64, 10)], ids=["gpt", "cnn"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(make: object) -> None:
    results = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model: nn.Module = make()  # type: ignore[operator]
        wrapped = checkpoint_blocks(model, "full" if ckpt else "false")
        expected = 2 if isinstance(model, GPT) else 4  # cnn: its 2 conv blocks and 2 Linear layers
        assert len(wrapped) == (expected if ckpt else 0)
        torch.manual_seed(1)
        if isinstance(model, GPT):
            x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
            loss = LanguageModel().loss(model(x), y)
        else:
            x, y = torch.rand(4, 64), torch.randint(0, 10, (4,))
            loss = Classification().loss(model(x), y)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))  # type: ignore[union-attr]
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b)


def test_cnn_on_digits_shapes_and_split() -> None:
    model = CNN(64, 10, channels=[8, 16])
    assert model(torch.rand(5, 64)).shape == (5, 10)
    names = [n for n, _ in pipeline_layers(model) or []]
    assert names[0] == "layers.0" and len(names) == 7
    plan = model.tp_plan()
    assert [type(v).__name__ for v in plan.values()] == ["ColwiseParallel", "RowwiseParallel"]
    with pytest.raises(ValueError, match="square"):
        CNN(60, 10)


def test_text_data_is_shifted_bytes_with_disjoint_splits() -> None:
    assert DEFAULT_FILE.is_file() and DEFAULT_FILE.stat().st_size < 1_000_000
    assert (DEFAULT_FILE.parent / "README.md").is_file() and (
        DEFAULT_FILE.parent / "LICENSE-PSF.txt"
    ).is_file()
    train, val = load_text(block_size=32), load_text(block_size=32, split="val")
    x, y = train[3]
    assert x.dtype == torch.int64 and x.shape == y.shape == (32,)
    torch.testing.assert_close(x[1:], y[:-1])
    assert len(train) > 8 * len(val) > 0
    raw = DEFAULT_FILE.read_bytes()
    assert bytes(x.tolist()) == raw[3 * 32 : 4 * 32]


def test_lm_task_loss_metric_and_perplexity() -> None:
    task = LanguageModel()
    logits = torch.zeros(2, 5, 7)
    target = torch.zeros(2, 5, dtype=torch.long)
    loss = task.loss(logits, target)
    assert loss.item() == pytest.approx(np.log(7))
    assert task.derived({"val/loss": loss.item()})["val/ppl"] == pytest.approx(7.0)
    assert task.tokens(None, target) == 10
    assert task.metric_sum(logits, target).item() == pytest.approx(2.0)  # argmax 0 == target 0


@pytest.mark.parametrize("suffix", [".npz", ".pt", ".csv"])
def test_files_data_reads_npz_pt_and_csv(tmp_path: Path, suffix: str) -> None:
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    y = np.array([0, 1, 0, 1])
    path = tmp_path / f"d{suffix}"
    if suffix == ".npz":
        np.savez(path, x=x, y=y)
    elif suffix == ".pt":
        torch.save({"x": torch.from_numpy(x), "y": torch.from_numpy(y)}, path)
    else:
        np.savetxt(path, np.column_stack([x, y]), delimiter=",")
    ds = load_files(str(path))
    assert ds is not None and len(ds) == 4
    xi, yi = ds[1]
    assert xi.tolist() == [3.0, 4.0, 5.0] and yi.dtype == torch.int64 and int(yi) == 1
    assert load_files(None) is None
    with pytest.raises(ValueError, match="unknown format"):
        load_files(str(tmp_path / "d.parquet"))


def test_fsdp_units_never_split_the_tied_embedding_and_head() -> None:
    """FSDP2 refuses a tied parameter in two units; the auto-wrap leaves it to a common ancestor."""
    from disttrain.strategies.fsdp import modules_to_wrap

    model = GPT(vocab_size=256, block_size=16, dim=32, n_layers=2, n_heads=4)
    tied = model.embed.tok.weight
    assert model.head.out.weight is tied
    # the default: the repeated blocks; the rest (embeddings, head) is under 1000 or tied: the root's
    assert modules_to_wrap(model, set(), min_num_params=1000) == [model.blocks[0], model.blocks[1]]
    one = GPT(vocab_size=256, block_size=16, dim=32, n_layers=1, n_heads=4)  # no repeated block
    by_size = modules_to_wrap(one, set(), min_num_params=1000)
    assert by_size and all(all(p is not one.embed.tok.weight for p in m.parameters()) for m in by_size)
    assert one.blocks[0].fc in by_size  # untied modules over the threshold still get units
    by_class = modules_to_wrap(model, {"Embedding", "Block"}, 0)
    assert by_class == [model.embed.pos, model.blocks[0], model.blocks[1]]  # not embed.tok

    class Pair(torch.nn.Module):  # an ancestor holding every holder of the tied weight may be a unit
        def __init__(self) -> None:
            super().__init__()
            self.inner = GPT(vocab_size=256, block_size=16, dim=32, n_layers=1, n_heads=4)

    outer = torch.nn.Sequential(Pair(), torch.nn.Linear(4, 4))
    assert modules_to_wrap(outer, {"GPT"}, 0) == [outer[0].inner]
    untied = GPT(vocab_size=256, block_size=16, dim=32, n_layers=1, n_heads=4, tie_weights=False)
    assert untied.head.out in modules_to_wrap(untied, set(), min_num_params=1000)
