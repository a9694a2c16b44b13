"""disttrain.config: every config composes and passes the static checks; every mistake is a ConfigError."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from unit_support import BAD_RUNTIME, BAD_STATIC, Bad, checked, split_flags

from disttrain.config import ConfigError, compose, config_dir, expand_sweep, resolve
from disttrain.config.errors import one_of
from disttrain.config.keyhelp import key_rows
from disttrain.config.run import Run
from disttrain.preflight.checks import check_static

# What the foundation issue promises in each group; new options may be added, none removed.
PROMISED = {
    "backend": {"auto", "gloo", "nccl"},
    "strategy": {"single", "ddp"},
    "model": {"mlp"},
    "data": {"digits", "synthetic"},
    "amp": {"off"},
    "optim": {"adamw", "sgd"},
    "sched": {"constant", "cosine"},
    "launcher": {"torchrun", "spawn"},
    "experiment": set(),
}

# Options that are only valid together with another setting.
NEEDS = {
    ("strategy", "single"): ["nproc_per_node=1"],
    ("strategy", "dp"): ["nproc_per_node=1"],
    ("model", "gpt"): ["data=text"],
    ("data", "files"): ["data.path=train.npz", "data.num_features=4", "data.num_classes=2"],
    ("data", "hf"): ["data.path=train.jsonl", "data.num_features=4", "data.num_classes=2"],
    ("data", "mix"): ["data.num_features=4", "data.num_classes=2"],
    ("data", "tokens"): ["data.path=train.bin"],
    ("launcher", "k8s"): ["launcher.image=ghcr.io/lab/train:1"],  # required: no image works silently
}

MESSAGE = re.compile(
    r"^config error: (?P<key>\S+?)=(?P<value>.*) is not valid\. Allowed: .+\. HINT: .+", re.S
)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


GROUPS = sorted(p.name for p in config_dir().iterdir() if p.is_dir())  # every group, new ones too


EVERY_OPTION = [pytest.param(g, o, id=f"{g}={o}") for g in GROUPS for o in options(g)]


def test_every_promised_group_and_option_exists() -> None:
    assert set(PROMISED) <= set(GROUPS)
    for group, promised in PROMISED.items():
        assert promised <= set(options(group)), f"configs/{group}/ lacks {promised - set(options(group))}"
    assert options("experiment"), "ship at least one example experiment"


def _config_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("defaults: []\n")
    return path


def test_config_dir_finds_the_wheels_layout_then_the_checkouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed wheel carries `disttrain/configs` (setup.py maps the top-level configs/ there);
    a checkout on PYTHONPATH or an editable install has them beside the package, at `configs/`."""
    from disttrain.config.compose import _builtin_config_dir

    monkeypatch.delenv("DISTTRAIN_CONFIG_DIR", raising=False)
    checkout = tmp_path / "checkout"
    (checkout / "disttrain").mkdir(parents=True)
    top = _config_folder(checkout / "configs")
    assert _builtin_config_dir(checkout / "disttrain") == top
    wheel = _config_folder(checkout / "disttrain" / "configs")  # the package's own wins
    assert _builtin_config_dir(checkout / "disttrain") == wheel

    site = tmp_path / "site-packages"
    (site / "disttrain").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="DISTTRAIN_CONFIG_DIR") as info:
        _builtin_config_dir(site / "disttrain")
    assert str(site / "disttrain" / "configs") in str(info.value)
    assert str(site / "configs") in str(info.value)

    # this checkout: the top-level configs/; DISTTRAIN_CONFIG_DIR comes first
    assert config_dir().resolve() == Path(__file__).resolve().parents[2] / "configs"
    monkeypatch.setenv("DISTTRAIN_CONFIG_DIR", str(top))
    assert config_dir() == top.resolve()


@pytest.mark.parametrize(("group", "option"), EVERY_OPTION)
def test_every_option_composes_and_passes_static_checks(group: str, option: str) -> None:
    """... and every key it has carries help text for `--help` (docs-as-written review 3.11: optim.lr,
    data.num_features had none: an option's new default hid its base schema's help)."""
    overrides = [f"{group}={option}", *NEEDS.get((group, option), [])]
    composed = compose(overrides)
    assert [key for key, _, _, text in key_rows(composed) if not text.strip()] == []
    cfg = resolve(composed, overrides)
    check_static(Run.of(cfg))
    if option in PROMISED.get(group, ()) and "name" in cfg[group]:
        assert cfg[group]["name"] == option
    assert "${" not in yaml.safe_dump(cfg), "every interpolation is resolved in the parent"


def test_gpt_brings_the_text_data_unless_data_is_chosen() -> None:
    """The brief's `disttrain train strategy=fsdp model=gpt amp=bf16` needs no data=text (nor task=lm)."""
    cfg = checked(["model=gpt", "strategy=fsdp", "amp=bf16"])
    assert (cfg["data"]["name"], cfg["model"]["vocab_size"], cfg["model"]["block_size"]) == ("text", 256, 64)
    assert cfg["task"]["_target_"] == "disttrain.tasks.LanguageModel"
    with pytest.raises(ConfigError, match="Expected tensor for argument #1 'indices' to have one of"):
        checked(["model=gpt", "data=synthetic"], runtime=True)  # an explicit choice wins: the dry step


def test_default_config() -> None:
    cfg = checked([])
    assert "hydra" not in cfg
    assert (cfg["backend"]["name"], cfg["strategy"]["name"], cfg["launcher"]["name"]) == (
        "auto",
        "ddp",
        "torchrun",
    )
    assert (cfg["data"]["name"], cfg["nodes"], cfg["nproc_per_node"]) == ("digits", 1, 2)
    assert cfg["model"]["_target_"] == "disttrain.models.mlp.MLP"
    assert (cfg["model"]["in_features"], cfg["model"]["num_classes"]) == (64, 10), (
        "widths follow the data group"
    )
    assert cfg["optim"]["_partial_"] is True
    assert set(cfg["trainer"]) >= {
        "max_epochs", "max_steps", "batch_size", "grad_accum", "clip_grad_norm", "log_every", "val_every",
        "ckpt_every",
    }  # fmt: skip


def test_overrides_are_applied_and_resolved() -> None:
    cfg = checked(["optim.lr=1e-2", "model.hidden=[256,256]", "data=synthetic", "seed=7"])
    assert cfg["optim"]["lr"] == pytest.approx(1e-2)
    assert cfg["model"]["hidden"] == [256, 256]
    assert cfg["data"]["name"] == "synthetic" and cfg["seed"] == 7
    assert (cfg["model"]["in_features"], cfg["model"]["num_classes"]) == (32, 4)
    assert cfg["data"]["train"]["num_samples"] == cfg["data"]["num_samples"] == 2048


def test_interpolations_follow_overrides_of_their_source() -> None:
    cfg = checked(["data=synthetic", "data.num_features=7", "data.num_classes=3", "data.num_samples=100"])
    assert (cfg["model"]["in_features"], cfg["model"]["num_classes"]) == (7, 3)
    assert cfg["data"]["train"]["num_samples"] == 100 and cfg["data"]["train"]["num_features"] == 7


def test_experiment_overrides_the_primary_config_and_the_command_line_overrides_both() -> None:
    cfg = checked(["experiment=digits_sgd"])
    assert cfg["name"] == "digits_sgd"
    assert (cfg["trainer"]["batch_size"], cfg["trainer"]["max_epochs"]) == (16, 15)
    assert cfg["optim"]["_target_"] == "torch.optim.SGD"
    cfg = checked(["experiment=digits_sgd", "trainer.batch_size=8", "name=mine"])
    assert (cfg["trainer"]["batch_size"], cfg["name"]) == (8, "mine")


def test_user_config_dir_adds_an_experiment_and_a_group_option(tmp_path: Path) -> None:
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "paper.yaml").write_text(
        "# @package _global_\n"
        "defaults:\n  - override /data: tiny\n  - override /optim: sgd\n"
        "name: paper\noptim:\n  lr: 0.123\ntrainer:\n  batch_size: 4\n"
    )
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tiny.yaml").write_text(
        "defaults:\n  - base_synthetic\n\nnum_samples: 64\nnum_features: 5\n"
    )
    cfg = checked(["experiment=paper"], config_dir=str(tmp_path))
    assert (cfg["name"], cfg["optim"]["lr"], cfg["trainer"]["batch_size"]) == ("paper", 0.123, 4)
    assert cfg["data"]["num_samples"] == 64 and cfg["model"]["in_features"] == 5
    assert "digits_sgd" in options("experiment"), "the built-in experiments stay on the search path"
    assert checked(["experiment=digits_sgd"], config_dir=str(tmp_path))["name"] == "digits_sgd"


def test_resolve_returns_plain_containers_without_hydra() -> None:
    full = compose(["seed=3"], with_hydra=True)
    assert "hydra" in full
    cfg = resolve(full)
    assert "hydra" not in cfg and cfg["seed"] == 3
    assert type(cfg["model"]["hidden"]) is list and type(cfg["trainer"]) is dict


# ------------------------------------------------------------------------------------------- errors
def test_config_error_message_format() -> None:
    err = ConfigError("trainer.batch_size", 0, "a number >= 1", "lower it.")
    assert (
        str(err) == "config error: trainer.batch_size=0 is not valid. Allowed: a number >= 1. HINT: lower it."
    )
    assert isinstance(err, ValueError)
    assert (err.key, err.value, err.allowed, err.hint) == (
        "trainer.batch_size",
        0,
        "a number >= 1",
        "lower it.",
    )
    assert "=null is" in str(ConfigError("k", None, "x", "y")) and "=''" in str(
        ConfigError("k", "", "x", "y")
    )
    assert one_of(["a", "b"]) == "one of a, b"


def raise_for(bad: Bad) -> ConfigError:
    """The ConfigError the CLI's pre-launch checks raise for `bad` (every job of a sweep)."""
    overrides, kwargs, multirun = split_flags(bad.argv)
    with pytest.raises(ConfigError) as info:
        for job in expand_sweep(overrides) if multirun else [overrides]:
            checked(job, runtime=bad.runtime, **kwargs)
    return info.value


@pytest.mark.parametrize("bad", [b.param for b in BAD_STATIC + BAD_RUNTIME])
def test_bad_input_raises_config_error_naming_key_value_allowed_and_hint(
    bad: Bad, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # --config-dir is relative to the working directory
    bad.make_files(tmp_path)
    err = raise_for(bad)
    m = MESSAGE.match(str(err))
    assert m is not None, f"not in the error format: {err}"
    assert (m["key"], m["value"]) == (bad.key, bad.shown(tmp_path)), str(err)
    assert err.allowed and err.hint, str(err)


def test_runtime_mistakes_pass_the_static_checks() -> None:
    """`disttrain config` (no torch) catches every static mistake; runtime ones pass it."""
    for bad in BAD_RUNTIME:
        overrides, _, multirun = split_flags(bad.argv)
        if not multirun:
            checked(overrides)  # composes and passes check_static


def test_unknown_key_lists_the_allowed_keys_and_suggests_the_close_one() -> None:
    with pytest.raises(ConfigError) as info:
        checked(["optim.lrr=1"])
    assert "lr" in info.value.allowed.split(": ", 1)[1].split(", ")
    assert "did you mean optim.lr?" in info.value.hint and "+" not in info.value.hint


def test_unknown_key_of_a_schema_block_does_not_recommend_plus() -> None:
    """D20: `+trainer.max_step=10` would be taken into the typed block and read by nothing."""
    with pytest.raises(ConfigError) as info:
        checked(["trainer.max_step=10"])
    assert info.value.key == "trainer.max_step" and "did you mean trainer.max_steps?" in info.value.hint
    assert "+trainer" not in info.value.hint


def test_unknown_option_lists_the_group_options_without_schema_bases() -> None:
    with pytest.raises(ConfigError) as info:
        checked(["strategy=nope"])
    assert info.value.allowed == one_of(options("strategy"))


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["nodes=0"], "nodes"),
        (["backend.timeout=0"], "backend.timeout"),
        (["launcher.max_restarts=-1"], "launcher.max_restarts"),
        (["trainer.max_steps=-1", "trainer.max_epochs=0"], "trainer.max_epochs"),
        (["trainer.log_every=0"], "trainer.log_every"),
        (["trainer.val_every=-1"], "trainer.val_every"),
        (["strategy.comm_hook=int8"], "strategy.comm_hook"),
        (["strategy.bucket_cap_mb=0"], "strategy.bucket_cap_mb"),
        (["sched.warmup_steps=-1"], "sched.warmup_steps"),
        (["data.task=ranking"], "data.task"),
    ],
)
def test_more_static_rules(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        checked(overrides)
    assert info.value.key == key


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.max_steps=5", "trainer.max_epochs=0"],  # max_epochs is ignored when max_steps is set
        ["trainer.clip_grad_norm=null"],
        ["strategy.comm_hook=bf16"],
        ["threads_per_rank=1"],
        ["nodes=2", "node_rank=1", "master_addr=10.0.0.1"],
        ["sched.min_lr_ratio=1.0", "optim.scale_lr=linear"],
        ["+model.width=512"],
        ["model.width=512"],  # the model node is open: a key for your own class needs no `+`
    ],
)
def test_valid_edge_values_pass(overrides: list[str]) -> None:
    checked(overrides)


def test_check_static_works_on_the_run_of_a_plain_dict() -> None:
    cfg: dict[str, Any] = checked([])
    cfg["trainer"]["batch_size"] = -3
    with pytest.raises(ConfigError, match=r"trainer\.batch_size=-3"):
        check_static(Run.of(cfg))


# ------------------------------------------------------------------------------------------- sweeps
def test_expand_sweep_gives_one_job_per_value() -> None:
    assert expand_sweep(["optim.lr=1e-3,1e-2", "seed=1"]) == [
        ["optim.lr=0.001", "seed=1"],
        ["optim.lr=0.01", "seed=1"],
    ]


def test_expand_sweep_takes_the_cartesian_product() -> None:
    jobs = expand_sweep(["optim.lr=1e-3,1e-2", "seed=1,2,3", "data=synthetic"])
    assert len(jobs) == 6
    assert all("data=synthetic" in job for job in jobs)
    assert len({tuple(job) for job in jobs}) == 6


def test_expand_sweep_without_a_sweep_is_one_job() -> None:
    assert expand_sweep(["seed=1"]) == [["seed=1"]]
    assert expand_sweep([]) == [[]]


def test_every_swept_job_composes() -> None:
    jobs = expand_sweep(["optim=adamw,sgd", "data=digits,synthetic"])
    cfgs = [checked(job) for job in jobs]
    assert {(c["optim"]["_target_"], c["data"]["name"]) for c in cfgs} == {
        (o, d) for o in ("torch.optim.AdamW", "torch.optim.SGD") for d in ("digits", "synthetic")
    }


# ---------------------------------------------- issue 25: closed choices are str enums in the schema
CLOSED = {
    "backend.name": ("auto", "gloo", "nccl"),
    "trainer.detect_anomaly": ("off", "stop", "skip"),
    "trainer.oom": ("off", "auto_microbatch"),
    "trainer.early_stop.mode": ("min", "max"),
    "checkpoint.verify": ("size", "hash"),
    "checkpoint.mode": ("min", "max"),
    "amp.dtype": ("float32", "bfloat16", "float16"),
    "optim.scale_lr": ("none", "linear"),
    "data.shard": ("none", "auto"),
}


# a strategy's own closed choices, in the config class beside its spec (the option that has the key)
STRATEGY_CLOSED = {
    "strategy.comm_hook": ("strategy=ddp", ("fp16", "bf16")),
    "strategy.param_dtype": ("strategy=fsdp", ("float32", "bfloat16", "float16")),
    "strategy.reduce_dtype": ("strategy=zero2", ("float32", "bfloat16", "float16")),
    "strategy.schedule": ("strategy=pipeline", ("gpipe", "1f1b", "interleaved_1f1b")),
}


@pytest.mark.parametrize("key", [*CLOSED, *STRATEGY_CLOSED])
def test_a_closed_choice_is_refused_at_composition_naming_its_members(key: str) -> None:
    option, members = STRATEGY_CLOSED.get(key, ("", CLOSED.get(key, ())))
    with pytest.raises(ConfigError) as info:
        compose([o for o in (option, f"{key}=bogus") if o])
    err = info.value
    assert (err.key, err.value, err.allowed) == (key, "bogus", "one of " + ", ".join(members))
    assert err.hint and err.hint != "pick one of them.", "the hint is the schema's help of the key"
    if option:  # every member composes, and reads back as the plain string in config.yaml
        for member in members:
            assert resolve(compose([option, f"{key}={member}"]))["strategy"][key.split(".")[1]] == member


def test_closed_choices_freeze_as_plain_strings_and_read_typed_as_members() -> None:
    from disttrain.config.common import Choice
    from disttrain.config.run import Run

    cfg = resolve(compose(["trainer.detect_anomaly=skip", "checkpoint.mode=max"]))
    assert type(cfg["trainer"]["detect_anomaly"]) is str and type(cfg["backend"]["name"]) is str
    assert "skip" in yaml.safe_dump(cfg)  # config.yaml stays plain YAML
    run = Run.of(cfg)
    mode = run.trainer.detect_anomaly
    assert isinstance(mode, Choice) and mode == "skip" and f"{mode}" == "skip" and str(mode) == "skip"
    assert run.checkpoint.mode == "max" and run.backend.name == "auto"
    rows = {key: kind for key, kind, _, _ in key_rows(compose([]))}
    assert rows["trainer.detect_anomaly"] == "off|stop|skip" and rows["checkpoint.verify"] == "size|hash"
    assert rows["checkpoint.mode"] == "null|min|max"  # optional: null is one of its values


def test_a_hand_edited_closed_choice_is_named_before_launch() -> None:
    """A config that did not come through composition (an edited config.yaml a resume reads)."""
    from disttrain.config.run import Run
    from disttrain.preflight.checks import check_static

    cfg = resolve(compose(["data=synthetic"]))
    cfg["trainer"]["oom"] = "retry"
    with pytest.raises(ConfigError) as info:
        check_static(Run.of(cfg))
    assert (info.value.key, info.value.value) == ("trainer.oom", "retry"), str(info.value)
    assert info.value.allowed == "one of off, auto_microbatch"


def test_a_hand_edited_data_option_key_is_named_as_the_run_is_typed() -> None:
    """Issue 39: the data option's own keys are typed and checked beside their fields (data/specs.py),
    so a config.yaml edited after composition meets them in Run.of, as the fixed blocks do."""
    import copy

    cfg = resolve(compose(["data=tokens", "data.path=/t.bin", "model=gpt"]))
    assert Run.of(cfg).data.option.sampling == "random"  # type: ignore[union-attr]
    for key, value, allowed in [
        ("dtype", "int8", "one of uint16, uint32"),
        ("block_size", 0, "a number >= 1"),
        ("val_fraction", 1.0, "a fraction in [0, 1)"),
    ]:
        edited = copy.deepcopy(cfg)
        edited["data"][key] = value
        with pytest.raises(ConfigError) as info:
            Run.of(edited)
        assert (info.value.key, info.value.value, info.value.allowed) == (f"data.{key}", value, allowed)


@pytest.mark.parametrize("overrides", [[], ["strategy=fsdp", "data=tokens", "data.path=/t.bin", "model=gpt"]])
def test_assignment_anywhere_under_a_run_raises(overrides: list[str]) -> None:
    """Issue 39: the Run is read-only to its leaves (review A.3: `run.trainer.batch_size = 999`
    succeeded while to_dict() still said 32)."""
    import dataclasses

    from disttrain.config.run import Run

    run = Run.of(resolve(compose(overrides), overrides))
    before = run.to_dict()
    seen: list[str] = []

    def walk(node: Any, path: str) -> None:
        seen.append(path)
        if dataclasses.is_dataclass(node):
            for f in dataclasses.fields(node):
                with pytest.raises(AttributeError, match="cannot assign"):
                    setattr(node, f.name, 999)
                walk(getattr(node, f.name), f"{path}.{f.name}")
        elif isinstance(node, dict):
            for change in (lambda: node.__setitem__("x", 1), lambda: node.update(x=1), node.clear):
                with pytest.raises(TypeError, match="read-only"):
                    change()
            for key, value in node.items():
                walk(value, f"{path}[{key!r}]")
        elif isinstance(node, list):
            for change in (lambda: node.append(1), lambda: node.__setitem__(slice(None), []), node.clear):
                with pytest.raises(TypeError, match="read-only"):
                    change()
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(run, "run")
    for name in ("model", "data", "task", "optim", "sched"):
        walk(getattr(run, name), name)
    assert {"run.trainer.early_stop.patience", "run.observe.sinks", "run.storage_options"} <= set(seen)
    assert "run.strategy.reshard_after_forward" in seen or not overrides
    assert len(seen) > 150
    assert run.to_dict() == before and run.trainer.batch_size == before["trainer"]["batch_size"]
