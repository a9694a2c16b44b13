"""Packed rows (data.packing=true) and instruction data (data.tokenizer): per-token losses of a packed
row equal each document's alone (built-in gpt, tiny Hugging Face GPT-2 and Llama), prompt tokens
train nothing, the tokenized set is cached, a packed run logs data/pad_frac and resumes bitwise, a
model that cannot keep documents apart is refused before launch. In process; the tokenizer is built
here (a WordLevel `tokenizers` model saved with save_pretrained): no hub."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from unit_support import checked, engine_of

from disttrain.config.errors import ConfigError
from disttrain.config.schema import Data
from disttrain.data import build_datasets
from disttrain.data.packing import IGNORE, PackedRows, row, window_row
from disttrain.models.gpt import GPT
from disttrain.tasks.builtin import LanguageModel, ModelLoss

pytestmark = pytest.mark.timeout(120)

DOCS = (5, 7, 6)  # three documents in a row of 24: 6 places of padding


def documents(vocab: int = 32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab, (n,), generator=g) for n in DOCS]


def per_token(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.flatten(0, -2).float(), target.flatten(), reduction="none", ignore_index=IGNORE
    )


def alone(model: Any, docs: list[torch.Tensor]) -> torch.Tensor:
    """Each document run by itself (no position_ids: the model's plain causal attention)."""
    out = []
    for d in docs:
        logits = model(d[None])
        out.append(per_token(getattr(logits, "logits", logits)[0, :-1], d[1:]))
    return torch.cat(out)


def packed_batch(docs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v[None] for k, v in row([(d, d) for d in docs], 24).items()}


def test_a_packed_row_holds_the_documents_with_positions_and_labels_restarting() -> None:
    docs = documents()
    r = row([(d, d) for d in docs], 24)
    assert r["position_ids"].tolist() == [*range(5), *range(7), *range(6), *range(6)]
    assert torch.equal(r["input_ids"][:18], torch.cat(docs)) and r["input_ids"][18:].eq(0).all()
    starts = [0, 5, 12]
    assert all(int(r["labels"][s]) == IGNORE for s in starts) and r["labels"][18:].eq(IGNORE).all()
    assert int((r["labels"] != IGNORE).sum()) == 18 - 3


@torch.no_grad()
def test_gpt_per_token_losses_of_a_packed_row_equal_each_document_alone() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=24, dim=16, n_layers=2, n_heads=2).eval()
    docs = documents()
    task = LanguageModel()
    inputs, target = task.unpack(packed_batch(docs))
    losses = per_token(task.forward(model, inputs, target), target)
    real = target.flatten() != IGNORE
    assert real.sum() == sum(DOCS) - len(DOCS)
    assert torch.allclose(losses[real], alone(model, docs), atol=1e-6, rtol=0)
    assert losses[~real].eq(0).all()
    assert int(task.tokens(inputs, target)) == 15 and task.slots(inputs, target) == 24
    unmasked = model(inputs["input_ids"])  # without positions the later documents see the earlier
    assert not torch.allclose(per_token(unmasked, target)[real], alone(model, docs), atol=1e-3)


def _hf(kind: str) -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_head=2, n_embd=16, vocab_size=32, n_positions=24, bos_token_id=1, eos_token_id=1
        )
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        hidden_size=16,
        intermediate_size=32,
        vocab_size=32,
        max_position_embeddings=24,
        bos_token_id=1,
        eos_token_id=1,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@torch.no_grad()
def test_hf_per_token_losses_of_a_packed_row_equal_each_document_alone(kind: str) -> None:
    """task=model_loss hands the packed row to the model (position_ids, use_cache=False): the
    model's own loss is the mean of the per-token losses of the documents alone."""
    model = _hf(kind)
    docs = documents()
    batch = packed_batch(docs)
    task = ModelLoss()
    inputs, target = task.unpack(batch)
    out = task.forward(model, inputs, target)
    shifted = F.pad(batch["labels"][..., 1:], (0, 1), value=IGNORE)
    losses = per_token(out.logits, shifted)
    expected = alone(model, docs)
    assert torch.allclose(losses[shifted.flatten() != IGNORE], expected, atol=1e-6, rtol=0)
    assert float(task.loss(out, target)) == pytest.approx(float(expected.mean()), abs=1e-6)
    assert int(task.tokens(inputs, target)) == 15 and task.slots(inputs, target) == 24


def test_token_windows_cut_documents_after_each_eos() -> None:
    window = torch.tensor([7, 8, 0, 5, 6, 9, 0, 4])
    r = window_row(window, eos_id=0)
    assert r["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert r["labels"].tolist() == [IGNORE, 8, 0, IGNORE, 6, 9, 0, IGNORE]


def test_next_fit_packs_in_order_and_counts_the_padding() -> None:
    docs = [{"input_ids": list(range(1, n + 1))} for n in (10, 3, 12, 30, 2)]
    rows = PackedRows(docs, block_size=16)
    assert rows.bounds.tolist() == [0, 2, 3, 4, 5]  # 10+3 | 12 | 30 (cut to 16) | 2
    assert len(rows) == 4 and rows.pad_fraction() == pytest.approx(1 - (13 + 12 + 16 + 2) / 64)
    one_each = PackedRows(docs, block_size=16, pack=False)
    assert len(one_each) == 5 and one_each[1]["position_ids"].tolist()[:4] == [0, 1, 2, 0]


# ------------------------------------------------------------------------------- instruction data
def _tokenizer(root: Path, chat: bool = True) -> Path:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<eos>", "<unk>", "user", "assistant", ":", "what", "is", "two", "plus", "four", "hi"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    if chat:
        fast.chat_template = (
            "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}"
        )
    fast.save_pretrained(root / "tok")
    return root / "tok"


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.chdir(tmp_path)
    return tmp_path


ROWS = [
    {"prompt": "what is two plus two", "completion": "four"},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi four"}]},
]
INSTRUCT = ("data=hf", "data.block_size=16", "data.cache_dir=tok_cache", "task=model_loss")


def test_prompt_tokens_contribute_zero_loss(hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One JSON-lines file mixing a prompt/completion row and a chat row (each read by its fields):
    only the completion and the assistant turn train; tokenized once, then read from the cache."""
    tok = _tokenizer(hf_cache)
    (hf_cache / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    over = [*INSTRUCT, "data.path=rows.jsonl", f"data.tokenizer={tok}", "model._target_=torch.nn.Identity"]
    data = checked(over)["data"]
    assert (
        Path(data["tokenizer"]).is_absolute() and Path(data["cache_dir"]).is_absolute()
    )  # a resume elsewhere
    train, _ = build_datasets(data)
    # "four <eos>" (ids 10, 1) after the prompt; the chat: "hi four <eos>" after "user : hi <eos> assistant :"
    for i, trained in enumerate(([10, 1], [11, 10, 1])):
        sample = train[i]
        assert sample["labels"][sample["labels"] != IGNORE].tolist() == trained
        model = GPT(vocab_size=16, block_size=16, dim=8, n_layers=1, n_heads=2)
        task = LanguageModel()
        inputs, target = task.unpack({k: v[None] for k, v in sample.items()})
        with torch.no_grad():
            losses = per_token(task.forward(model, inputs, target), target)
        prompt = target.flatten() == IGNORE
        assert (
            losses[prompt].eq(0).all()
            and losses[~prompt].gt(0).all()
            and int((~prompt).sum()) == len(trained)
        )
        with torch.no_grad():
            assert float(task.loss(task.forward(model, inputs, target), target)) == pytest.approx(
                float(losses[~prompt].mean()), abs=1e-6
            )

    import disttrain.data.tokenize as tokenize

    monkeypatch.setattr(tokenize, "load_tokenizer", lambda path: pytest.fail("tokenized twice"))
    again, _ = build_datasets(checked(over)["data"])
    assert torch.equal(again[1]["labels"], train[1]["labels"])
    assert len([p for p in (hf_cache / "tok_cache").iterdir() if p.is_dir()]) == 1


def test_a_chat_row_without_a_template_is_one_paragraph(hf_cache: Path) -> None:
    tok = _tokenizer(hf_cache, chat=False)
    (hf_cache / "rows.jsonl").write_text(json.dumps(ROWS[1]) + "\n")
    over = [*INSTRUCT, "data.path=rows.jsonl", f"data.tokenizer={tok}", "model._target_=torch.nn.Identity"]
    with pytest.raises(ConfigError) as err:
        build_datasets(checked(over)["data"])
    assert err.value.key == "data.tokenizer" and "chat template" in str(err.value)


# ------------------------------------------------------------------------------------- config
def test_model_loss_needs_no_sizes_and_gpt_names_the_one_it_reads() -> None:
    hf = ("data=hf", "data.path=x.jsonl")
    cfg = checked([*hf, "task=model_loss", "model._target_=torch.nn.Identity"])
    assert cfg["data"]["num_classes"] is None and cfg["data"]["num_features"] is None
    with pytest.raises(ConfigError) as err:
        checked([*hf, "model=gpt", "data.block_size=16"])
    assert (err.value.key, err.value.value) == ("data.num_classes", None) and "model.vocab_size" in str(
        err.value
    )
    assert (
        checked([*hf, "model=gpt", "data.block_size=16", "data.num_classes=8"])["model"]["block_size"] == 16
    )


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (("data=tokens", "data.path=x.bin", "data.packing=true"), "data.eos_id"),
        (("data=hf", "data.path=x.jsonl", "data.packing=true", "data.num_features=8"), "data.block_size"),
        (
            ("data=hf", "data.path=x.jsonl", "data.packing=true", "data.block_size=8", "data.streaming=true",
             "trainer.max_steps=2"),
            "data.packing",
        ),
    ],
)  # fmt: skip
def test_packing_mistakes_name_the_key(argv: tuple[str, ...], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        checked(["model=gpt", "data.num_classes=16", *argv])
    assert err.value.key == key, err.value


class NoPositions(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 16)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        return F.cross_entropy(self.emb(input_ids).flatten(0, 1), labels.flatten().clamp(min=0))


class IgnoresPositions(torch.nn.Module):
    """Takes position_ids and attends over the whole row anyway (a running mean of the row)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 16)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(input_ids)
        return x.cumsum(1) / torch.arange(1, x.shape[1] + 1)[:, None]


@pytest.mark.parametrize(
    ("model", "why"), [(NoPositions, "no position_ids"), (IgnoresPositions, "across documents")]
)
def test_a_model_that_cannot_keep_documents_apart_is_refused(model: type, why: str) -> None:
    from types import SimpleNamespace

    from disttrain.preflight.packing import check_documents, check_model

    batch = {k: v[None] for k, v in row([(torch.arange(1, 6), torch.arange(1, 6))] * 2, 12).items()}
    run: Any = SimpleNamespace(data=Data.of({"packing": True}))
    with pytest.raises(ConfigError) as err:
        check_model(run, model(), batch)
        check_documents(run, model(), batch)
    assert err.value.key == "data.packing" and why in str(err.value)
    check_model(run, GPT(vocab_size=16, block_size=12, dim=8, n_layers=1, n_heads=2), batch)
    check_documents(run, GPT(vocab_size=16, block_size=12, dim=8, n_layers=1, n_heads=2), batch)


# ------------------------------------------------------------------------ a packed run, resumed
def _token_file(path: Path) -> Path:
    """Documents of 3..20 tokens (ids 1..15), each ended by EOS 0."""
    rng = np.random.default_rng(0)
    ids: list[int] = []
    while len(ids) < 4000:
        ids += [*rng.integers(1, 16, rng.integers(3, 21)).tolist(), 0]
    np.asarray(ids, dtype=np.uint16).tofile(path)
    return path


def test_a_packed_tokens_run_logs_pad_frac_and_resumes_bitwise(tmp_path: Path, one_rank: None) -> None:
    from disttrain.observe.metrics import read_metrics

    run = (
        "model=gpt", "model.dim=16", "model.n_layers=1", "model.n_heads=2", "data=tokens",
        f"data.path={_token_file(tmp_path / 'docs.bin')}", "data.block_size=32", "data.num_classes=16",
        "data.packing=true", "data.eos_id=0", "strategy=single", "nproc_per_node=1", "trainer.progress=false",
        "trainer.batch_size=4", "trainer.log_every=1", "observe.sinks=[]", "threads_per_rank=1", "sched=constant",
        "trainer.max_steps=4", "trainer.ckpt_every=2", "trainer.val_every=0", "model.dropout=0.1",
    )  # fmt: skip
    straight = engine_of(tmp_path / "straight", run)
    straight.fit()
    first = engine_of(tmp_path / "resumed", [*run, "trainer.max_steps=2"])
    first.fit()
    again = engine_of(tmp_path / "resumed", run)
    assert again.resume(again.ckpt.dir) is not None and again.state.step == 2
    again.fit()
    for a, b in zip(straight.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)
    logged = [r for r in read_metrics(tmp_path / "straight") if "train/loss" in r]
    resumed = {r["step"]: r["train/loss"] for r in read_metrics(tmp_path / "resumed") if "train/loss" in r}
    assert resumed == {r["step"]: r["train/loss"] for r in logged}
    # about one EOS in 12 tokens: the next document's first token and the row's last target are masked
    assert all(0.04 < r["data/pad_frac"] < 0.25 and r["tokens_per_s"] > 0 for r in logged)
