"""disttrain.preflight.model: the parent's pre-launch checks take the user's model factory as written
(issue 23): a `from_pretrained` target is checked through its config on the meta device, a factory
that loads its own weights file is never built for real in the parent, and any other exception from
a factory is one paragraph."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from unit_support import checked, write_module

from disttrain.config.errors import ConfigError
from disttrain.preflight.model import model_for_checks

HF = "transformers.AutoModelForCausalLM.from_pretrained"
LM = ("data=text", "data.block_size=32", "task=model_loss", "task.call={input_ids: x, labels: x}")
PLAIN_LM = ("data=text", "data.block_size=32", "task=lm")  # model(x) -> logits

# A user's factory that loads its own weights with safetensors, recording every call it gets (the
# default device it ran under) and every weights-file read in a JSON-lines file beside it.
ST_FACTORY = """\
import json, os
import torch
from safetensors.torch import load_file

LOG = os.path.join(os.path.dirname(__file__), "calls.jsonl")


def _record(event):
    with open(LOG, "a") as f:
        f.write(json.dumps({"event": event, "device": torch.get_default_device().type}) + "\\n")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 16)
        self.head = torch.nn.Linear(16, 256)

    def forward(self, x):
        return self.head(self.embed(x))


def net(path):
    _record("factory")
    model = Net()
    state = load_file(path)
    _record("load_file")
    model.load_state_dict(state)
    return model


def create_model(name, checkpoint_path):  # timm's shape: build by name, then load the checkpoint
    _record("factory")
    model = {"net": Net}[name]()
    state = torch.load(checkpoint_path, map_location="cpu")
    _record("load_file")
    model.load_state_dict(state)
    return model


def refuses_meta():
    _record("factory")
    if torch.get_default_device().type == "meta":
        raise RuntimeError("this factory cannot run under a meta device context")
    return Net()


def broken(path):
    raise FileNotFoundError(f"no weights at {path}\\n(second line)")
"""


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    write_module(tmp_path, "stlab.factory", ST_FACTORY)
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("stlab")]:
        del sys.modules[name]


def _calls(user_dir: Path) -> list[dict[str, str]]:
    log = user_dir / "stlab" / "calls.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def test_from_pretrained_passes_the_checks_by_its_structure_without_weights(tiny_gpt2: Path) -> None:
    """The review's reproduction: `from_pretrained` refuses a meta context; before the fix the checks
    ended in a traceback. Now its structure (from_config) is checked on meta, overrides applied."""
    checked([*LM, f"model._target_={HF}", f"model.pretrained_model_name_or_path={tiny_gpt2}"], runtime=True)
    model = model_for_checks(
        {"_target_": HF, "pretrained_model_name_or_path": str(tiny_gpt2), "resid_pdrop": 0.0}
    )
    assert model.meta is not None and type(model.meta).__name__ == "GPT2LMHeadModel"
    assert all(p.is_meta for p in model.meta.parameters())
    assert sum(p.numel() for p in model.meta.parameters()) == 35_712  # the saved model's size
    assert model.meta.config.resid_pdrop == 0.0  # from_pretrained's config overrides hold
    assert model.build_cpu is not None
    from safetensors.torch import load_file

    weights = load_file(tiny_gpt2 / "model.safetensors")
    cpu = model.build_cpu().state_dict()  # the dry step's CPU model: random-initialised, not loaded
    key = "transformer.h.0.attn.c_attn.weight"
    assert cpu[key].shape == weights[key].shape and not torch.equal(cpu[key], weights[key])


def test_a_missing_pretrained_folder_is_one_paragraph(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError) as err:  # before: a traceback (Hydra's InstantiationException)
        checked([*LM, f"model._target_={HF}", f"model.pretrained_model_name_or_path={missing}"], runtime=True)
    assert err.value.key == "model.pretrained_model_name_or_path" and err.value.value == str(missing)
    assert "raised OSError: " in err.value.hint and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "factory",
    [
        ("model._target_=stlab.factory.net", "model.path=w.safetensors"),
        ("model._target_=stlab.factory.create_model", "model.name=net", "model.checkpoint_path=w.pt"),
    ],
    ids=["safetensors", "timm-style"],
)
def test_a_factory_that_loads_its_own_weights_is_never_built_for_real_in_the_parent(
    user_dir: Path, caplog: pytest.LogCaptureFixture, factory: tuple[str, ...]
) -> None:
    """The parent calls it once, under the meta device, and never again on the CPU for the dry step
    (before: a second, real build that read the weights into the parent)."""
    from safetensors.torch import save_file

    weights = {"embed.weight": torch.randn(256, 16), **_head()}
    save_file(weights, str(user_dir / "w.safetensors"))
    torch.save(weights, user_dir / "w.pt")
    with caplog.at_level(logging.INFO, "disttrain"):
        checked([*PLAIN_LM, *factory], runtime=True)
    assert [c["device"] for c in _calls(user_dir) if c["event"] == "factory"] == ["meta"]
    assert "loads its own weights" in caplog.text


def test_a_factory_that_refuses_meta_is_skipped_with_one_logged_line(
    user_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "disttrain"):
        checked([*PLAIN_LM, "model._target_=stlab.factory.refuses_meta"], runtime=True)
    assert [c["device"] for c in _calls(user_dir)] == ["meta"]  # no CPU build in the parent
    (record,) = [r for r in caplog.records if "model checks skipped" in r.getMessage()]
    assert "stlab.factory.refuses_meta" in record.getMessage() and "\n" not in record.getMessage()


def test_any_other_exception_from_a_factory_is_one_paragraph(user_dir: Path) -> None:
    with pytest.raises(ConfigError) as err:  # before: a traceback (Hydra's InstantiationException)
        checked([*PLAIN_LM, "model._target_=stlab.factory.broken", "model.path=w.safetensors"], runtime=True)
    assert (err.value.key, err.value.value) == ("model._target_", "stlab.factory.broken")
    assert "it raised FileNotFoundError: no weights at w.safetensors (at " in err.value.hint
    assert f"(at {user_dir / 'stlab' / 'factory.py'}:" in err.value.hint  # where, without a traceback
    assert "second line" not in str(err.value)


def _head() -> dict[str, torch.Tensor]:
    return {"head.weight": torch.randn(256, 16), "head.bias": torch.randn(256)}
