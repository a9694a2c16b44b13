"""Strategy mistakes caught before any rank starts (moved from the integration suite: one process).

`disttrain config` / `disttrain train` run in-process through cli.main (unit_support.disttrain_in_process):
exit 2, one paragraph naming the key with the numbers and a hint, no traceback, no run dir.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from unit_support import disttrain_in_process, write_module

from disttrain.config import compose, resolve
from disttrain.config.errors import ConfigError
from disttrain.config.run import Run
from disttrain.preflight.checks import check_static

FAST = ("trainer.progress=false", "threads_per_rank=1")


def config_error(cwd: Path, *overrides: str, command: str = "config") -> str:
    proc = disttrain_in_process(command, *FAST, *overrides, cwd=cwd)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not list(cwd.rglob("config.yaml")), "a config error must not create a run dir"
    return proc.stderr


# ------------------------------------------------------------------------------- data parallel
@pytest.mark.parametrize(
    ("overrides", "key", "numbers"),
    [
        (("strategy=dp",), "nproc_per_node", "1 x 2 = 2"),
        (("strategy=hsdp", "nproc_per_node=3"), "strategy.replicate", "divisor of the world size 3"),
        (("strategy=fsdp", "strategy.replicate=0"), "strategy.replicate", ">= 1"),
        (("strategy=fsdp", "strategy.param_dtype=float64"), "strategy.param_dtype", "bfloat16"),
        (("strategy=localsgd", "strategy.sync_every=0"), "strategy.sync_every", ">= 1"),
        (
            ("strategy=localsgd", "strategy.comm_hook=fp16"),
            "strategy.comm_hook",
            "null with strategy=localsgd",
        ),
        (("strategy=zero", "strategy.comm_hook=int8"), "strategy.comm_hook", "fp16"),
        (("strategy=ddp", "backend=gloo", "strategy.comm_hook=bf16"), "strategy.comm_hook", "gloo"),
    ],
)
def test_data_parallel_config_checks(overrides: tuple[str, ...], key: str, numbers: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_static(Run.of(resolve(compose(list(overrides)), list(overrides))))
    assert info.value.key == key
    assert numbers in str(info.value)
    assert "HINT" in str(info.value)


def test_bad_wrap_class_fails_before_launch(scratch: Path) -> None:
    err = config_error(scratch, "strategy=fsdp", "strategy.wrap_classes=[Linearr]", command="train")
    assert "strategy.wrap_classes" in err and "Linear, MLP" in err
    assert not (scratch / "runs").exists()


def test_a_container_wrap_class_fails_before_launch(scratch: Path) -> None:
    """fully_shard refuses a ModuleList (the gpt's blocks) in every rank; the meta model says so first."""
    err = config_error(
        scratch,
        "model=gpt",
        "data=text",
        "strategy=fsdp",
        "strategy.wrap_classes=[ModuleList]",
        command="train",
    )
    assert "strategy.wrap_classes=['ModuleList']" in err and "containers without forward" in err
    assert "Block" in err  # the classes it could name instead


# ------------------------------------------------------------------------------- model parallel
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("strategy=pipeline", "strategy.n_microbatches=5"), "divisor of trainer.batch_size=32"),
        (("strategy=pipeline", "strategy.schedule=interleaved_1f1b"), "strategy.stages_per_rank=1"),
        (("strategy=pipeline", "strategy.n_microbatches=1"), ">= the number of stages (2)"),
        (
            ("strategy=fsdp+tp", "strategy.dp_degree=2"),
            "2 x 2 = 4, world size nodes x nproc_per_node = 1 x 2 = 2",
        ),
        (("strategy=fsdp+tp", "strategy.tp_degree=3"), "a divisor of the world size 2"),
        (("strategy=tp", "nproc_per_node=1"), ">= 2 ranks with strategy=tp"),
        (("strategy=tp", "strategy.tp_plan={layers.1: colwize}"), "style names one of colwise, rowwise"),
    ],
)
def test_model_parallel_static_config_errors(
    scratch: Path, overrides: tuple[str, ...], expected: str
) -> None:
    assert expected in config_error(scratch, *overrides)


def test_too_many_stages_fails_before_launch(scratch: Path) -> None:
    err = config_error(
        scratch,
        "strategy=pipeline",
        "strategy.schedule=interleaved_1f1b",
        "strategy.stages_per_rank=2",
        "model.hidden=[]",
        command="train",
    )
    assert "4 stages but only 2 splittable layers" in err and "layers.0, layers.1" in err


def test_model_without_tp_plan_fails_before_launch(scratch: Path) -> None:
    write_module(
        scratch,
        "mylab.nets",
        "import torch\n\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self, in_features, num_classes):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(in_features, num_classes)\n\n"
        "    def forward(self, x):\n"
        "        return self.fc(x.flatten(1))\n",
    )
    wired = ("model.in_features=${data.num_features}", "model.num_classes=${data.num_classes}")
    err = config_error(scratch, "strategy=tp", "model._target_=mylab.nets.Net", *wired, command="train")
    assert "model=mylab.nets.Net" in err and "tp_plan()" in err and "ddp" in err


def test_tp_plan_pattern_selecting_no_module_fails_before_launch(scratch: Path) -> None:
    """The MLP's Linears are layers.1, layers.3, layers.5: a plan naming layers.9 splits nothing."""
    plan = "strategy.tp_plan={layers.1: colwise, layers.9: rowwise}"
    err = config_error(scratch, "strategy=tp", plan, command="train")
    assert "strategy.tp_plan={'layers.1': 'colwise', 'layers.9': 'rowwise'}" in err
    assert "'layers.9' selects none" in err and "'layers' selects layers, whose children are 0, 1, 2" in err


def test_a_pipeline_stage_without_parameters_fails_before_launch(scratch: Path) -> None:
    """Review F7: the docs' Sequential(Unflatten, net) cut in two leaves stage 0 without parameters
    ("optimizer got an empty parameter list" in rank 0 after launch). Here: the mlp's Flatten alone."""
    err = config_error(scratch, "strategy=pipeline", "model.hidden=[]", command="train")
    assert "strategy.split_points=null" in err and "stage 0: layers.0 would hold no parameters" in err
    assert "only 1 layer(s) hold parameters (layers.1): use at most 1 stages" in err


def test_a_parameterless_stage_names_split_points_that_give_each_stage_one() -> None:
    from disttrain.strategies.specs.model_parallel import PipelineStrategyConfig, _check_stages_train

    names, trained = ["unflatten", "conv", "fc"], [False, True, True]
    with pytest.raises(ConfigError) as info:
        _check_stages_train(PipelineStrategyConfig(), names, trained, [0, 1, 3])  # the even split
    assert info.value.key == "strategy.split_points" and "strategy.split_points=[fc]" in str(info.value)
    _check_stages_train(PipelineStrategyConfig(split_points=["fc"]), names, trained, [0, 2, 3])


def test_a_parameterless_stage_beside_a_trained_one_on_its_rank_is_allowed() -> None:
    """stages_per_rank=2 on 2 ranks: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3; stage 2
    without parameters trains beside stage 0 (docs/strategies.md's interleaved_1f1b command on the
    default mlp). A rank whose stages are all parameterless is still refused."""
    from disttrain.strategies.specs.model_parallel import PipelineStrategyConfig, _check_stages_train

    names = [f"layers.{i}" for i in range(6)]
    trained = [False, True, False, True, False, True]
    two = PipelineStrategyConfig(stages_per_rank=2)
    _check_stages_train(two, names, trained, [0, 2, 4, 5, 6])  # stage 2 = layers.4: rank 0 has stage 0
    with pytest.raises(ConfigError):
        _check_stages_train(two, names, [False, False, False, True, False, True], [0, 1, 2, 3, 6])
