"""optim.fused (issue 34 #4, review §4.5 #2): auto fuses the optimizer where every parameter is a
floating CUDA tensor. No GPU here: the decision reads a parameter's device type and whether it is
floating, so CUDA parameters are stand-ins with those two (torch's FakeTensorMode would do too, at
~10 CPU-s of imports); the optimizers themselves are built on CPU parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from unit_support import checked

from disttrain.config.errors import ConfigError
from disttrain.config.schema import Optim
from disttrain.engine.optim import build_optimizer, use_fused

ADAMW = {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3, "weight_decay": 0.01}


class OnCuda:
    device = torch.device("cuda", 0)

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point


def cuda_params(*dtypes: torch.dtype) -> list[Any]:
    return [OnCuda(d) for d in dtypes]


def test_auto_fuses_only_floating_cuda_parameters_of_a_class_that_can() -> None:
    on_cuda = cuda_params(torch.float32, torch.bfloat16)
    assert use_fused("auto", ADAMW, on_cuda) is True
    assert use_fused("auto", ADAMW, [{"params": on_cuda[:1]}, {"params": on_cuda[1:], "lr": 0.1}]) is True
    assert use_fused("auto", {**ADAMW, "_target_": "torch.optim.SGD"}, on_cuda) is True
    # the class's own default (foreach on CUDA) wherever any condition fails
    assert use_fused("auto", ADAMW, [*on_cuda, torch.nn.Parameter(torch.zeros(2))]) is None  # one on CPU
    assert use_fused("auto", ADAMW, [*on_cuda, *cuda_params(torch.int64)]) is None  # not floating
    assert use_fused("auto", {**ADAMW, "foreach": True}, on_cuda) is None  # the user chose foreach
    assert use_fused("auto", {**ADAMW, "_target_": "torch.optim.RMSprop"}, on_cuda) is None  # no `fused`
    assert use_fused("auto", ADAMW, []) is None
    assert use_fused(False, ADAMW, on_cuda) is False and use_fused(True, ADAMW, []) is True


def test_build_optimizer_passes_the_choice_and_refuses_fused_where_the_class_has_none() -> None:
    """Built as the pre-launch check builds it (checking=True: the class's own code, without the
    first call's ~2 CPU-s torch._dynamo import)."""
    model = torch.nn.Linear(4, 4)
    auto = build_optimizer(Optim.of({**ADAMW, "fused": "auto"}), model, 1, checking=True)
    assert auto.defaults["fused"] is None  # CPU parameters: as before
    params = (p for p in model.parameters())  # a generator: read by the decision and by the class
    fused = build_optimizer(Optim.of({**ADAMW, "fused": True}), params, 1, checking=True)
    assert fused.defaults["fused"] is True and len(fused.param_groups[0]["params"]) == 2
    with pytest.raises(ConfigError) as info:
        build_optimizer(
            Optim.of({**ADAMW, "_target_": "torch.optim.RMSprop", "fused": True}), model, 1, checking=True
        )
    assert info.value.key == "optim.fused" and "takes no `fused`" in str(info.value)


def test_a_fused_value_other_than_auto_true_false_is_refused_before_launch() -> None:
    with pytest.raises(ConfigError) as info:
        checked(["optim.fused=1"])  # 1 == True: a plain membership test would let it through
    assert info.value.key == "optim.fused" and "auto, true or false" in str(info.value)
