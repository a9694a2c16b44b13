"""Every config group instantiates: data sets, models on their shapes, optimizers, schedules, strategies.

Also `disttrain.config.instantiate.build`, the forgiving `_target_` builder the user's code plugs into.
"""

from __future__ import annotations

import importlib
import itertools
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from unit_support import checked, write_module

from disttrain.config import ConfigError, compose, config_dir, resolve
from disttrain.config.gpus import choose_backend
from disttrain.config.instantiate import build, check, locate
from disttrain.config.run import Run
from disttrain.config.schema import Optim, Sched
from disttrain.data import build_datasets
from disttrain.dist import DistEnv
from disttrain.engine.optim import build_optimizer, build_scheduler, effective_lr, lr_lambda
from disttrain.models import build_model
from disttrain.preflight.checks import check_runtime, check_static
from disttrain.strategies import build_strategy, specs

DIGITS = 1797  # images in the bundled data set


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A working directory on sys.path, as the CLI puts the user's cwd (modules unloaded after)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("unitlab"):
            del sys.modules[name]


# ------------------------------------------------------------------------------------------ data
# files reads arrays written here; text is a sequence set (more in test_models.py)
@pytest.mark.parametrize("data", options("data"))
def test_every_data_option_builds_train_and_val_with_the_declared_shapes(data: str, tmp_path: Path) -> None:
    if data in ("hf", "mix"):  # dict rows from files, a mixture of sources: their own tests
        pytest.skip("tests/unit/test_data_hf.py and test_data_mix.py build them")
    if data == "files":
        rng = np.random.default_rng(0)
        for name in ("train", "val"):
            np.savez(tmp_path / f"{name}.npz", x=rng.random((20, 4)), y=rng.integers(0, 3, 20))
        overrides = [f"data.path={tmp_path / 'train.npz'}", f"data.val_path={tmp_path / 'val.npz'}",
                     "data.num_features=4", "data.num_classes=3"]  # fmt: skip
    elif data == "tokens":
        (np.arange(2000) % 50).astype(np.uint16).tofile(tmp_path / "train.bin")
        overrides = [f"data.path={tmp_path / 'train.bin'}", "data.val_fraction=0.1", "data.block_size=16"]
    else:
        overrides = []
    cfg = checked([f"data={data}", *overrides])["data"]
    if data in ("text", "tokens"):
        train, val = build_datasets(cfg)
        x, y = train[0]
        assert x.shape == y.shape == (cfg["num_features"],) and int(x.max()) < cfg["num_classes"]
        assert len(val) > 0
        return
    train, val = build_datasets(cfg)
    assert val is not None
    for ds in (train, val):
        x, y = ds[:]  # TensorDataset
        assert x.dtype == torch.float32 and x.shape[1:].numel() == cfg["num_features"]
        assert y.dtype == torch.int64 and y.shape == (len(ds),)
        assert int(y.min()) >= 0 and int(y.max()) < cfg["num_classes"]
    if data == "digits":
        assert len(train) + len(val) == DIGITS and len(val) == round(0.2 * DIGITS)
        assert float(train[:][0].min()) >= 0.0 and float(train[:][0].max()) <= 1.0
    if data == "synthetic":
        assert (len(train), len(val)) == (cfg["num_samples"], cfg["num_val_samples"])


def test_digits_split_is_fixed_and_disjoint() -> None:
    cfg = checked([])["data"]
    (train, val), (train2, _) = build_datasets(cfg), build_datasets(cfg)
    assert torch.equal(train[:][0], train2[:][0])
    rows = {tuple(r.tolist()) for r in train[:][0]}
    assert sum(tuple(r.tolist()) in rows for r in val[:][0]) < 0.05 * len(val)  # a few duplicate images


def test_synthetic_sizes_follow_overrides_and_regression_gives_one_hot_targets() -> None:
    cfg = checked(["data=synthetic", "data.num_samples=96", "data.num_val_samples=40", "task=regression"])
    train, val = build_datasets(cfg["data"])
    assert (len(train), len(val)) == (96, 40)
    x, y = train[:]
    assert x.shape == (96, 32) and y.shape == (96, 4) and y.dtype == torch.float32
    assert torch.equal(y.sum(dim=1), torch.ones(96))


def test_no_val_set_when_val_is_null() -> None:
    train, val = build_datasets(checked(["data=synthetic", "data.val=null"])["data"])
    assert val is None and len(train) == 2048


BAD_FILES = {
    "missing": None,
    "a-folder": "folder",
    "no-x-array": b"",
    "empty": b"",
    "not-a-zip": b"garbage " * 8,
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
@pytest.mark.parametrize("key", ["data.path", "data.val_path"])
def test_bad_data_file_is_a_config_error_naming_its_key(tmp_path: Path, kind: str, key: str) -> None:
    """D11: these were Hydra tracebacks (FileNotFoundError, KeyError, EOFError, BadZipFile...)."""
    good, bad = tmp_path / "good.npz", tmp_path / f"{kind}.npz"
    np.savez(good, x=np.zeros((8, 4)), y=np.zeros(8, dtype=np.int64))
    if kind == "a-folder":
        bad.mkdir()
    elif kind == "no-x-array":
        np.savez(bad, inputs=np.zeros((8, 4)))
    elif BAD_FILES[kind] is not None:
        bad.write_bytes(BAD_FILES[kind])  # type: ignore[arg-type]
    paths = {"data.path": good, "data.val_path": good, key: bad}
    overrides = ["data=files", "data.num_features=4", "data.num_classes=3", "trainer.batch_size=2"]
    with pytest.raises(ConfigError) as info:
        checked([*overrides, *(f"{k}={v}" for k, v in paths.items())], runtime=True)
    assert (info.value.key, info.value.value) == (key, str(bad)) and info.value.hint


def test_missing_text_file_is_a_config_error_naming_data_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        checked(["model=gpt", f"data.path={tmp_path / 'nope.txt'}"], runtime=True)
    assert info.value.key == "data.path" and "FileNotFoundError" in info.value.hint


@pytest.mark.parametrize(
    ("override", "key"),
    [("data.block_size=0", "data.block_size"), ("data.val_fraction=1", "data.val_fraction"),
     ("data.val_fraction=-0.5", "data.val_fraction")],
)  # fmt: skip
def test_text_data_ranges_are_checked_before_launch(override: str, key: str) -> None:
    """block_size=0 divided by zero in a rank; val_fraction=-0.5 reported a perfect model (D12)."""
    with pytest.raises(ConfigError) as info:
        checked(["model=gpt", override])
    assert info.value.key == key


# ----------------------------------------------------------------------------------------- model
# Which built-in data sets each model takes: cnn needs square images, gpt token sequences.
PAIRS = {"mlp": ("digits", "synthetic"), "cnn": ("digits",), "gpt": ("text",)}
SMALL = {"mlp": ["model.hidden=[16,8]"], "cnn": ["model.channels=[4]"], "gpt": ["model.dim=16"]}


def test_every_model_has_data_it_runs_on() -> None:
    assert set(PAIRS) == set(options("model"))


@pytest.mark.parametrize(("model", "data"), [(m, d) for m, ds in PAIRS.items() for d in ds])
def test_every_model_runs_on_its_data_sets(model: str, data: str) -> None:
    cfg = checked([f"model={model}", f"data={data}", *SMALL[model]])
    train, _ = build_datasets(cfg["data"])
    net = build_model(cfg["model"])
    assert isinstance(net, torch.nn.Module)
    x = torch.stack([train[i][0] for i in range(5)])
    out = net(x)
    assert out.shape[0] == 5 and out.shape[-1] == cfg["data"]["num_classes"]


def test_mlp_layers_follow_the_config() -> None:
    cfg = checked(["model.hidden=[256,256]", "model.activation=gelu", "model.dropout=0.1"])
    net = build_model(cfg["model"])
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 256), (256, 256), (256, 10)]
    assert any(isinstance(m, torch.nn.GELU) for m in net.modules())
    assert any(isinstance(m, torch.nn.Dropout) for m in net.modules())


def test_check_runtime_returns_the_data_set_sizes() -> None:
    sizes = check_runtime(Run.of(checked([])))
    assert sizes == {"train": DIGITS - round(0.2 * DIGITS), "val": round(0.2 * DIGITS)}
    assert check_runtime(Run.of(checked(["data=synthetic", "data.val=null"]))) == {"train": 2048}


def test_check_runtime_accepts_the_largest_batch_that_fits() -> None:
    n = checked(["data=synthetic"])["data"]["num_samples"]  # 2 ranks x grad_accum 2 x batch
    check_runtime(Run.of(checked(["data=synthetic", "trainer.grad_accum=2", f"trainer.batch_size={n // 4}"])))
    with pytest.raises(ConfigError, match=rf"trainer\.batch_size={n // 4 + 1} .*<= {n // 4} for {n}"):
        check_runtime(
            Run.of(checked(["data=synthetic", "trainer.grad_accum=2", f"trainer.batch_size={n // 4 + 1}"]))
        )


def test_ranks_that_split_the_model_share_a_batch_in_the_data_size_check() -> None:
    """tp and pipeline ranks read the same samples: one step takes batch x grad_accum, not x world."""
    n = 2048
    check_runtime(Run.of(checked(["data=synthetic", "strategy=tp", f"trainer.batch_size={n}"])))
    with pytest.raises(ConfigError, match=r"1 data-parallel replica\(s\)"):
        check_runtime(Run.of(checked(["data=synthetic", "strategy=tp", f"trainer.batch_size={n + 1}"])))
    with pytest.raises(ConfigError, match=rf"<= {n // 2} for {n}"):
        check_runtime(Run.of(checked(["data=synthetic", "strategy=ddp", f"trainer.batch_size={n}"])))


# ------------------------------------------------------------------------------------ user targets
NET = """
from torch import nn


class Net(nn.Module):
    def __init__(self, in_features: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, num_classes))

    def forward(self, x):
        return self.body(x)
"""

DATA = """
import torch
from torch.utils.data import TensorDataset


def make_train(n: int = 50):
    return TensorDataset(torch.randn(n, 64), torch.randint(0, 10, (n,)))
"""


CNN = """
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int, hidden_size: int = 64, channels: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(), nn.Flatten(),
            nn.Linear(channels * 64, hidden_size), nn.ReLU(), nn.Linear(hidden_size, num_classes),
        )

    def forward(self, x):
        return self.body(x)
"""

NANO = """
from dataclasses import dataclass

from torch import nn


@dataclass
class GPTConfig:
    n_layer: int = 2
    n_embd: int = 16


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed = nn.Embedding(256, config.n_embd)
        self.layers = nn.ModuleList(nn.Linear(config.n_embd, config.n_embd) for _ in range(config.n_layer))
        self.head = nn.Linear(config.n_embd, 256)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def config_kwargs(n_layer: int = 2, **kwargs):
    return GPTConfig(n_layer=n_layer, **kwargs)
"""

WIRED = ["model.in_features=${data.num_features}", "model.num_classes=${data.num_classes}"]


def test_swapped_model_target_starts_from_a_clean_node(user_dir: Path) -> None:
    """No `+`, no leftover mlp keys: the node holds exactly what the user wrote (and what took effect)."""
    write_module(user_dir, "unitlab.nets", NET)
    cfg = checked(["model._target_=unitlab.nets.Net", *WIRED, "model.width=512"])
    assert cfg["model"] == {
        "_target_": "unitlab.nets.Net",
        "in_features": 64,
        "num_classes": 10,
        "width": 512,
    }
    net = build_model(cfg["model"])
    assert net.body[1].out_features == 512 and net.body[1].in_features == 64
    check_runtime(Run.of(cfg))


def test_user_class_with_defaults_needs_only_the_keys_it_changes(user_dir: Path) -> None:
    write_module(user_dir, "unitlab.cnn", CNN)
    cfg = checked(["model._target_=unitlab.cnn.SmallCNN", "model.num_classes=${data.num_classes}",
                   "model.hidden_size=32"])  # fmt: skip
    assert cfg["model"] == {"_target_": "unitlab.cnn.SmallCNN", "num_classes": 10, "hidden_size": 32}
    assert build_model(cfg["model"]).body[4].out_features == 32


@pytest.mark.parametrize("plus", ["", "+"])
def test_typo_in_a_user_model_argument_names_it_and_suggests_the_right_one(user_dir: Path, plus: str) -> None:
    """The old builder dropped `+model.hiden_size` with a warning and trained the default model."""
    write_module(user_dir, "unitlab.cnn", CNN)
    with pytest.raises(ConfigError) as info:
        checked(["model._target_=unitlab.cnn.SmallCNN", "model.num_classes=10", f"{plus}model.hiden_size=128"],
                runtime=True)  # fmt: skip
    assert (info.value.key, info.value.value) == ("model.hiden_size", 128)
    assert "did you mean model.hidden_size?" in info.value.hint
    assert "hidden_size" in info.value.allowed and "+" not in info.value.hint


def test_typo_in_a_nested_target_is_a_config_error_naming_the_nested_key(user_dir: Path) -> None:
    """nanoGPT's `GPT(config)`: the nested GPTConfig's keys are checked before anything is built."""
    write_module(user_dir, "unitlab.nano", NANO)
    base = [
        "data=text",
        "task=lm",
        "model._target_=unitlab.nano.GPT",
        "model.config._target_=unitlab.nano.GPTConfig",
    ]
    cfg = checked([*base, "model.config.n_layer=3"], runtime=True)
    assert cfg["model"] == {
        "_target_": "unitlab.nano.GPT",
        "config": {"_target_": "unitlab.nano.GPTConfig", "n_layer": 3},
    }
    assert len(build_model(cfg["model"]).layers) == 3
    with pytest.raises(ConfigError) as info:
        checked([*base, "+model.config.n_layr=4"], runtime=True)
    assert info.value.key == "model.config.n_layr" and "did you mean model.config.n_layer?" in info.value.hint


def test_kwargs_targets_are_checked_where_their_signature_allows(user_dir: Path) -> None:
    write_module(user_dir, "unitlab.nano", NANO)
    spec = {"_target_": "unitlab.nano.config_kwargs", "n_embd": 8}  # passed on through **kwargs
    assert build(spec, "model.config").n_embd == 8
    with pytest.raises(ConfigError) as info:  # close to the named n_layer: a typo, not a kwarg
        build({**spec, "n_layr": 4}, "model.config")
    assert info.value.key == "model.config.n_layr" and "n_layer" in info.value.hint
    with pytest.raises(ConfigError) as info:  # what **kwargs passes on fails inside: still one paragraph
        build({**spec, "n_emb": 4}, "model.config")
    assert info.value.key == "model.config.n_emb" and "unexpected keyword argument" in info.value.hint


def test_experiment_in_a_config_dir_swaps_model_and_data_targets_cleanly(user_dir: Path) -> None:
    write_module(user_dir, "unitlab.nets", NET)
    write_module(user_dir, "unitlab.data", DATA)
    (user_dir / "conf" / "experiment").mkdir(parents=True)
    (user_dir / "conf" / "experiment" / "mine.yaml").write_text(
        "# @package _global_\n"
        "model:\n  _target_: unitlab.nets.Net\n  width: 96\n"
        "  in_features: ${data.num_features}\n  num_classes: ${data.num_classes}\n"
        "data:\n  train:\n    _target_: unitlab.data.make_train\n    n: 60\n  val: null\n"
    )
    cfg = checked(
        ["experiment=mine", "trainer.batch_size=10"], runtime=True, config_dir=str(user_dir / "conf")
    )
    assert cfg["model"] == {"_target_": "unitlab.nets.Net", "width": 96, "in_features": 64, "num_classes": 10}
    assert cfg["data"]["train"] == {"_target_": "unitlab.data.make_train", "n": 60}
    assert cfg["data"]["val"] is None and cfg["data"]["name"] == "digits"


def test_swapped_optimizer_keeps_disttrains_own_keys_and_drops_adamws() -> None:
    cfg = checked(["optim._target_=torch.optim.RMSprop", "optim.alpha=0.9", "optim.lr=0.02"], runtime=True)
    assert cfg["optim"] == {"_target_": "torch.optim.RMSprop", "_partial_": True, "lr": 0.02, "weight_decay": 0.0,
                            "scale_lr": "none", "param_groups": None, "fused": "auto", "alpha": 0.9}  # fmt: skip
    opt = build_optimizer(Optim.of(cfg["optim"]), torch.nn.Linear(2, 2), world_size=1)
    assert isinstance(opt, torch.optim.RMSprop) and opt.param_groups[0]["alpha"] == 0.9


def test_swapped_optimizer_without_weight_decay_and_the_arguments_disttrain_passes() -> None:
    """LBFGS takes no weight_decay: the clean node's 0 (none) is not forced on it; `params` and a
    scheduler's `optimizer` are passed by disttrain, so they are not offered as suggestions."""
    cfg = checked(["optim._target_=torch.optim.LBFGS"], runtime=True)
    assert isinstance(
        build_optimizer(Optim.of(cfg["optim"]), torch.nn.Linear(2, 2), world_size=1), torch.optim.LBFGS
    )
    with pytest.raises(ConfigError) as info:
        checked(["optim.param=1"], runtime=True)
    assert info.value.key == "optim.param" and "params" not in info.value.allowed
    with pytest.raises(ConfigError) as info:
        checked(["sched._target_=torch.optim.lr_scheduler.StepLR", "sched.step_size=2", "sched.optimizr=1"],
                runtime=True)  # fmt: skip
    assert "optimizer" not in info.value.hint + info.value.allowed


def test_frozen_config_of_a_swapped_node_rebuilds_the_same_objects(user_dir: Path) -> None:
    """config.yaml is plain YAML; building from it again gives the same model, bit for bit."""
    import yaml

    write_module(user_dir, "unitlab.nets", NET)
    cfg = checked(["model._target_=unitlab.nets.Net", *WIRED, "model.width=8"])
    frozen = yaml.safe_load(yaml.safe_dump(cfg, sort_keys=False))
    torch.manual_seed(0)
    a = build_model(cfg["model"]).state_dict()
    torch.manual_seed(0)
    b = build_model(frozen["model"]).state_dict()
    assert frozen["model"] == cfg["model"] and all(torch.equal(a[k], b[k]) for k in a)


def test_misspelt_key_of_a_built_in_node_is_caught_without_torch() -> None:
    with pytest.raises(ConfigError) as info:
        checked(["model.hiden=[256,256]"])
    assert info.value.key == "model.hiden" and "did you mean model.hidden?" in info.value.hint
    assert "+" not in info.value.hint


def test_user_model_missing_required_argument_is_a_config_error(user_dir: Path) -> None:
    write_module(user_dir, "unitlab.nets", NET)
    with pytest.raises(ConfigError) as info:
        checked(["model._target_=unitlab.nets.Net", *WIRED], runtime=True)
    assert info.value.key == "model.width" and "model.width=VALUE" in info.value.hint
    assert "+model" not in info.value.hint  # the swapped node is clean and open: no `+`


def test_user_data_target(user_dir: Path) -> None:
    write_module(user_dir, "unitlab.data", DATA)
    cfg = checked(
        [
            "data.train._target_=unitlab.data.make_train",
            "data.train.n=40",
            "data.val=null",
            "trainer.batch_size=20",
        ]
    )
    assert cfg["data"]["train"] == {"_target_": "unitlab.data.make_train", "n": 40}  # no digits keys left
    assert check_runtime(Run.of(cfg)) == {"train": 40}  # 2 ranks x batch 20 fit


# ------------------------------------------------------------------------------------------- build
def test_build_passes_extras_and_rejects_keys_the_target_does_not_take() -> None:
    lin = build({"_target_": "torch.nn.Linear", "in_features": 3, "bias": False}, "model", out_features=2)
    assert isinstance(lin, torch.nn.Linear) and lin.weight.shape == (2, 3) and lin.bias is None
    with pytest.raises(ConfigError) as info:
        build({"_target_": "torch.nn.Linear", "in_features": 3, "junk": 1}, "model", out_features=2)
    assert (info.value.key, info.value.value) == ("model.junk", 1)


@pytest.mark.parametrize(
    ("spec", "key"),
    [
        ({"in_features": 3}, "model"),  # no _target_
        ([1, 2], "model"),
        ({"_target_": ""}, "model._target_"),
        ({"_target_": "torch.nn.NoSuchLayer"}, "model._target_"),
        ({"_target_": "torch.nn.Linear", "in_features": 3}, "model.out_features"),
        (
            {"_target_": "disttrain.models.mlp.MLP", "in_features": 3, "num_classes": 2, "activation": "x"},
            "model",
        ),
    ],
)
def test_build_turns_user_mistakes_into_config_errors(spec: object, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(spec, "model")
    assert info.value.key == key and info.value.hint


def test_build_keeps_real_bugs_as_they_are(user_dir: Path) -> None:
    """A ValueError or TypeError is the user's value or call being rejected (issue 11: one paragraph);
    any other error inside the target is a bug there and keeps its traceback."""
    with pytest.raises(ConfigError) as info:
        build({"_target_": "torch.nn.Linear", "in_features": "three", "out_features": 2}, "model")
    assert info.value.key == "model" and "TypeError" in info.value.hint
    write_module(user_dir, "unitlab.buggy", "def make(n: int = 1):\n    return n / 0\n")
    with pytest.raises(Exception) as raised:
        build({"_target_": "unitlab.buggy.make"}, "model")
    assert not isinstance(raised.value, ConfigError)


def test_locate_finds_classes_and_functions() -> None:
    assert locate("torch.optim.SGD", "optim._target_") is torch.optim.SGD
    assert callable(locate("disttrain.data.digits.load_digits", "data.train._target_"))


def test_a_bad_target_says_what_python_said_and_the_closest_names(user_dir: Path) -> None:
    """Issue 37 (review 2026-11-28-ux #4): `optim._target_=torch.optim.Adamw` said only "Error
    loading 'torch.optim.Adamw':": the cause was dropped and AdamW not suggested. `check` is what
    the runtime checks run on every `_target_` node before launch (a ConfigError: exit 2)."""
    with pytest.raises(ConfigError) as info:
        check({"_target_": "torch.optim.Adamw", "_partial_": True, "lr": 0.1}, "optim", supplied=1)
    assert info.value.key == "optim._target_" and info.value.value == "torch.optim.Adamw"
    hint = info.value.hint
    assert "Python says AttributeError: module 'torch.optim' has no attribute 'Adamw'." in hint, hint
    assert "Did you mean optim._target_=torch.optim.AdamW (or " in hint, hint
    assert "\n" not in str(info.value), "one paragraph"
    write_module(user_dir, "unitlab.nets", NET)
    with pytest.raises(ConfigError) as info:  # the user's own class, a package in its path misspelt
        locate("unitlab.nest.Net", "model._target_")
    hint = info.value.hint
    assert "AttributeError: module 'unitlab' has no attribute 'nest'" in hint, hint
    assert "Did you mean model._target_=unitlab.nets.Net?" in hint, hint
    write_module(user_dir, "unitlab.broken", "import unitlab_missing_dependency\n\nclass Net: ...\n")
    with pytest.raises(ConfigError) as info:  # the module exists but fails to import: that error
        locate("unitlab.broken.Net", "model._target_")
    hint = info.value.hint
    said = "importing unitlab.broken raised ModuleNotFoundError: No module named 'unitlab_missing_dependency'"
    assert said in hint and "Did you mean" not in hint, hint


# ------------------------------------------------------------------------------------ optimizers
@pytest.mark.parametrize("optim", options("optim"))
def test_every_optimizer_builds_from_its_partial(optim: str) -> None:
    cfg = checked([f"optim={optim}", "optim.lr=0.02"])["optim"]
    model = torch.nn.Linear(4, 2)
    opt = build_optimizer(Optim.of(cfg), model, world_size=2)
    assert type(opt) is locate(cfg["_target_"], "optim._target_")
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(0.02) and group["weight_decay"] == pytest.approx(cfg["weight_decay"])
    if optim == "sgd":
        assert group["momentum"] == pytest.approx(cfg["momentum"])
    if optim == "adamw":
        assert tuple(group["betas"]) == pytest.approx(tuple(cfg["betas"]))
    before = model.weight.detach().clone()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    assert not torch.equal(before, model.weight), "the optimizer updates the parameters"


def test_linear_scaling_rule() -> None:
    cfg = checked(["optim.lr=0.01", "optim.scale_lr=linear"])["optim"]
    assert effective_lr(Optim.of(cfg), 4) == pytest.approx(0.04)
    assert effective_lr(Optim.of({**cfg, "scale_lr": "none"}), 4) == pytest.approx(0.01)
    opt = build_optimizer(Optim.of(cfg), torch.nn.Linear(2, 2).parameters(), world_size=4)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.04)


# ------------------------------------------------------------------------------------- schedules
def test_cosine_warms_up_linearly_then_decays_to_the_floor() -> None:
    f = lr_lambda(Sched.of({"name": "cosine", "warmup_steps": 4, "min_lr_ratio": 0.1}), total_steps=14)
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f(4) == pytest.approx(1.0)  # cosine starts at the base lr
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half way
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    decay = [f(s) for s in range(4, 15)]
    assert all(a >= b for a, b in itertools.pairwise(decay))
    s = 6
    assert f(s) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 4) / 10)))


def test_cosine_without_warmup_decays_to_zero_by_default() -> None:
    cfg = checked(["sched=cosine", "sched.warmup_steps=0"])["sched"]
    assert cfg["min_lr_ratio"] == 0.0
    f = lr_lambda(Sched.of(cfg), total_steps=10)
    assert f(0) == pytest.approx(1.0) and f(5) == pytest.approx(0.5) and f(10) == pytest.approx(0.0)


def test_constant_with_and_without_warmup() -> None:
    f = lr_lambda(Sched.of(checked(["sched=constant"])["sched"]), total_steps=10)
    assert [f(s) for s in (0, 5, 50)] == [1.0, 1.0, 1.0]
    f = lr_lambda(Sched.of({"name": "constant", "warmup_steps": 2}), total_steps=10)
    assert [f(s) for s in (0, 1, 2, 9)] == pytest.approx([0.5, 1.0, 1.0, 1.0])


def _lrs(cfg: dict, steps: int = 30) -> list[float]:
    opt = build_optimizer(Optim.of(cfg["optim"]), torch.nn.Linear(2, 2), world_size=1)
    scheduler = build_scheduler(Sched.of(cfg["sched"]), opt, total_steps=steps)
    lrs = []
    for _ in range(steps):  # the engine steps the scheduler once per optimizer step
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("sched", [s for s in options("sched") if s in ("constant", "cosine")])
def test_every_built_in_schedule_drives_the_optimizer_lr(sched: str) -> None:
    cfg = checked([f"sched={sched}", "optim.lr=0.1"])
    f = lr_lambda(Sched.of(cfg["sched"]), total_steps=30)
    assert _lrs(cfg) == [0.1 * f(s) for s in range(30)]  # bitwise: the same LambdaLR as before


def test_any_torch_scheduler_class_by_target_steps_per_optimizer_step() -> None:
    cfg = checked(["sched._target_=torch.optim.lr_scheduler.StepLR", "sched.step_size=10", "sched.gamma=0.5",
                   "optim.lr=0.1"], runtime=True)  # fmt: skip
    assert cfg["sched"] == {"_target_": "torch.optim.lr_scheduler.StepLR", "_partial_": True, "step_size": 10,
                            "gamma": 0.5}  # fmt: skip
    assert _lrs(cfg) == [0.1] * 10 + [0.05] * 10 + [0.025] * 10


def test_onecycle_option_gets_the_runs_total_steps() -> None:
    cfg = checked(["sched=onecycle", "optim.lr=0.1"], runtime=True)
    lrs = _lrs(cfg)
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    ref = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=30)
    expected = []
    for _ in range(30):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step()
    assert lrs == expected and max(lrs) == pytest.approx(0.1)


def test_scheduler_mistakes_are_config_errors_before_launch() -> None:
    with pytest.raises(ConfigError) as info:
        checked(["sched._target_=torch.optim.lr_scheduler.StepLR", "sched.step_sze=10"], runtime=True)
    assert info.value.key == "sched.step_sze" and "did you mean sched.step_size?" in info.value.hint
    with pytest.raises(ConfigError) as info:  # forgot the _target_: cosine has no such key
        checked(["sched.step_size=10"])
    assert info.value.key == "sched.step_size" and "sched._target_=" in info.value.hint


def test_a_warm_up_as_long_as_the_run_is_named_before_launch(capsys: pytest.CaptureFixture[str]) -> None:
    """Review 2026-11-28-ux #14: `trainer.max_steps=20` under cosine's 20 warm-up steps trained at a
    rising lr that never decayed, without a word."""
    from unit_support import checked_run

    from disttrain.preflight.checks import check_optim_runtime, warmup_warning

    check_optim_runtime(checked_run(["trainer.max_steps=20", "optim=sgd"]), torch.nn.Linear(4, 2), 45)
    err = capsys.readouterr().err
    assert err == (
        "disttrain: warning: sched.warmup_steps=20 is not shorter than the run (20 optimizer steps): the lr "
        "climbs for the whole run and never decays. HINT: sched.warmup_steps=2 (a tenth of the run), or "
        "sched.warmup_steps=0.\n"
    )
    assert warmup_warning(Sched.of({"name": "cosine", "warmup_steps": 20}), 21) is None
    assert "climbs for the whole run. " in str(
        warmup_warning(Sched.of({"name": "constant", "warmup_steps": 50}), 30)
    )
    assert warmup_warning(Sched.of({"name": "cosine", "warmup_steps": 0}), 0) is None
    assert (
        warmup_warning(Sched.of({"_target_": "torch.optim.lr_scheduler.StepLR", "warmup_steps": 5}), 3)
        is None
    )


def test_a_rerun_that_changes_the_runs_length_is_warned_about_its_warm_up_again(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`disttrain rerun`/`resume` check the run dir's config.yaml again (`launched`): the warm-up
    warning its launch gave is not repeated (test_owners' rerun), unless a key it reads changed:
    here the run's length, 6 -> 4 steps, both under cosine's 20 warm-up steps."""
    from unit_support import checked, checked_run

    from disttrain.preflight.checks import check_runtime

    launched = checked(["data=synthetic", "trainer.max_steps=6"])
    check_runtime(checked_run(["data=synthetic", "trainer.max_steps=4"]), launched=launched)
    assert "sched.warmup_steps=20 is not shorter than the run (4 optimizer steps)" in capsys.readouterr().err


# ------------------------------------------------------------------------------- param groups
GROUPS = """
def by_name(model, head_lr: float = 0.5):
    head = [p for n, p in model.named_parameters() if n.startswith("head")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("head")]
    return [{"params": rest}, {"params": head, "lr": head_lr}]
"""


def test_no_decay_groups_of_the_built_in_gpt() -> None:
    cfg = checked(["model=gpt", "model.dim=16", "optim.param_groups=no_decay_bias_norm_embed"], runtime=True)
    model = build_model(cfg["model"])
    opt = build_optimizer(Optim.of(cfg["optim"]), model, world_size=1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, exempt = ({names[id(p)] for p in g["params"]} for g in opt.param_groups)
    assert opt.param_groups[0]["weight_decay"] == cfg["optim"]["weight_decay"] > 0
    assert opt.param_groups[1]["weight_decay"] == 0.0
    assert {"embed.tok.weight", "embed.pos.weight"} <= exempt  # the tied head shares embed.tok.weight
    assert all(n.endswith(".bias") or ".ln" in n or n.startswith("embed.") for n in exempt), exempt
    assert decay and all(n.endswith(".weight") and ".ln" not in n for n in decay), decay
    assert len(decay) + len(exempt) == len(list(model.parameters()))


def test_no_decay_1d_is_nanogpts_rule() -> None:
    """Review F5: nanoGPT decays every >= 2-D parameter, embeddings (and the head tied to one) too."""
    cfg = checked(["model=gpt", "model.dim=16", "optim.param_groups=no_decay_1d"], runtime=True)
    model = build_model(cfg["model"])
    opt = build_optimizer(Optim.of(cfg["optim"]), model, world_size=1)
    decay, exempt = ({id(p) for p in g["params"]} for g in opt.param_groups)
    assert decay == {id(p) for p in model.parameters() if p.dim() >= 2}  # nanoGPT's configure_optimizers
    assert id(model.embed.tok.weight) in decay and exempt == {
        id(p) for p in model.parameters() if p.dim() < 2
    }


def test_a_run_frozen_before_param_groups_still_resumes() -> None:
    """`disttrain resume` checks and builds from an old config.yaml that lacks optim.param_groups."""
    cfg = checked([])
    del cfg["optim"]["param_groups"]
    check_static(Run.of(cfg))
    check_runtime(Run.of(cfg))
    assert len(build_optimizer(Optim.of(cfg["optim"]), torch.nn.Linear(2, 2), world_size=1).param_groups) == 1


def test_user_param_group_factory_is_called_with_the_model(user_dir: Path) -> None:
    write_module(user_dir, "unitlab.groups", GROUPS)
    cfg = checked(["model=gpt", "model.dim=16", "optim.param_groups._target_=unitlab.groups.by_name",
                   "optim.param_groups.head_lr=0.25"], runtime=True)  # fmt: skip
    opt = build_optimizer(Optim.of(cfg["optim"]), build_model(cfg["model"]), world_size=1)
    assert [g["lr"] for g in opt.param_groups] == [cfg["optim"]["lr"], 0.25]
    with pytest.raises(ConfigError) as info:
        checked(["optim.param_groups._target_=unitlab.groups.by_name", "optim.param_groups.head_l=1"],
                runtime=True)  # fmt: skip
    assert info.value.key == "optim.param_groups.head_l"


# ------------------------------------------------------------------------------ strategy, backend
@pytest.mark.parametrize("name", sorted(specs.names()))
def test_every_strategy_name_maps_to_an_importable_class(name: str) -> None:
    module, _, cls = specs.get(name).target.partition(":")
    assert isinstance(getattr(importlib.import_module(module), cls), type)


@pytest.mark.parametrize("strategy", options("strategy"))
def test_every_strategy_option_names_a_known_strategy(strategy: str) -> None:
    assert resolve(compose([f"strategy={strategy}"]))["strategy"]["name"] in specs.names()


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_foundation_strategies_build_without_a_process_group(strategy: str) -> None:
    cfg = checked([f"strategy={strategy}", "nproc_per_node=1"])
    env = DistEnv(0, 0, 1, 1, "gloo", torch.device("cpu"))
    assert build_strategy(cfg["strategy"], env).name == strategy


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is nccl with CUDA GPUs")
def test_auto_backend_is_gloo_without_gpus() -> None:
    assert choose_backend("auto") == "gloo"
    assert choose_backend("gloo") == "gloo"


def test_type_errors_from_inside_a_kwargs_target_are_one_paragraph(user_dir: Path) -> None:
    """A target that forwards **kwargs to a class (disttrain.testing.FaultMLP -> MLP) reports missing
    arguments in the plural, or other call mistakes: each one paragraph naming the node, no traceback."""
    with pytest.raises(ConfigError) as info:
        build({"_target_": "disttrain.testing.FaultMLP"}, "model")
    assert info.value.key == "model.in_features" and "missing 2 required" in info.value.hint
    write_module(user_dir, "unitlab.fwd", "def make(**kw):\n    return int(*kw.values())\n")
    with pytest.raises(ConfigError) as info:
        build({"_target_": "unitlab.fwd.make", "a": 1, "b": 2}, "model")
    assert info.value.key == "model" and "TypeError" in info.value.hint
