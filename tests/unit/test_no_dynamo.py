"""config/no_dynamo.py: the pre-launch checks build optimizers and run models without importing
torch._dynamo, fall back to the real module when the stand-in is not enough, and leave no trace."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

SCRIPT = r"""
import json, sys
import torch
from disttrain.config.no_dynamo import without_dynamo

def check():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)
    return float(model(torch.ones(1, 4)).sum().detach() * 0 + 7)

calls = []
def asks_more():
    calls.append(1)
    import torch._dynamo
    return torch._dynamo.is_compiling()  # the stand-in answers disable() only

out = {"value": without_dynamo(check), "imported_after_check": "torch._dynamo" in sys.modules}
add = torch.optim.Optimizer.add_param_group.__wrapped__
out["cache_left"] = "__dynamo_disable" in add.__dict__
out["asks_more"] = without_dynamo(asks_more)
out["runs"] = len(calls)
out["real_after"] = type(sys.modules["torch._dynamo"]).__name__
print(json.dumps(out))
"""


def test_checks_without_dynamo_then_the_real_one_when_asked_for_more() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["value"] == 7.0
    assert out["imported_after_check"] is False  # an optimizer, a scheduler, a forward: no torch._dynamo
    assert out["cache_left"] is False  # the wrapper the stand-in answered will ask the real module
    assert out["asks_more"] is False and out["runs"] == 2  # once with the stand-in, once for real
    assert out["real_after"] == "module"  # the real torch._dynamo, not the stand-in


def test_an_error_the_stand_in_did_not_cause_is_raised_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from disttrain.config import no_dynamo

    monkeypatch.delitem(sys.modules, no_dynamo.NAME, raising=False)
    calls = []

    def bad() -> None:
        calls.append(1)
        raise ValueError("model.width=-1")

    with pytest.raises(ValueError, match="width"):
        no_dynamo.without_dynamo(bad)
    assert calls == [1]
    assert no_dynamo.NAME not in sys.modules or type(sys.modules[no_dynamo.NAME]).__name__ == "module"


def test_the_stand_in_answers_disable_forms_and_counts_a_submodule_import() -> None:
    """transformers decorates with `@torch.compiler.disable(reason=...)` at import (answered by the
    stand-in) and imports torch._dynamo submodules: the import machinery asks for `__path__`, which
    marks the attempt (the checks run again with the real module) where `__file__`, asked of every
    module by inspect.getmodule, does not."""
    from disttrain.config.no_dynamo import _Standin

    standin, fn = _Standin(), (lambda: None)
    assert standin.disable(fn, False, reason="views") is fn
    assert standin.disable(recursive=False, reason="views")(fn) is fn  # the decorator form
    assert not standin.asked_more
    with pytest.raises(AttributeError):
        _ = standin.__file__
    assert not standin.asked_more
    with pytest.raises(AttributeError):
        _ = standin.__path__
    assert standin.asked_more


RANK_SCRIPT = r"""
import json, sys
import torch
import torch.distributed as dist
from disttrain.config.no_dynamo import NAME, defer_dynamo

defer_dynamo()
deferred = sys.modules[NAME]
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)
for _ in range(2):
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    sched.step()
from torch.distributed.checkpoint.state_dict import get_state_dict
get_state_dict(model, opt)
out = {"trained_without_dynamo": deferred.real is None and sys.modules[NAME] is deferred}
add = torch.optim.Optimizer.add_param_group.__wrapped__
out["answered"] = "__dynamo_disable" in add.__dict__
out["compiled"] = float(torch.compile(lambda x: x * 2, backend="eager")(torch.ones(1))[0])
out["real_after"] = type(sys.modules[NAME]).__name__
out["cache_forgotten"] = add.__dict__.get("__dynamo_disable") is not add
out["forwards"] = deferred.is_compiling is sys.modules[NAME].is_compiling
opt.zero_grad()
out["step_after"] = bool(model(torch.ones(1, 4)).sum().backward() is None and opt.step() is None)
out["known"] = {
    "get_optimize_ddp_mode": torch._dynamo.utils.get_optimize_ddp_mode(),
    "clear_lru_cache": callable(torch._dynamo.trace_rules.clear_lru_cache),
    "OptimizedModule": isinstance(torch._dynamo.eval_frame.OptimizedModule, type),
    "graph_break": torch._dynamo.graph_break() is None,
}
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_a_rank_trains_without_dynamo_and_imports_it_when_something_compiles() -> None:
    """defer_dynamo (forked ranks): DDP, an optimizer step, a scheduler and DCP's get_state_dict
    need no torch._dynamo; torch.compile imports the real one, the cached `disable` answers are
    forgotten, and the known answers equal the real module's."""
    proc = subprocess.run([sys.executable, "-c", RANK_SCRIPT], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["trained_without_dynamo"] is True
    assert out["answered"] is True  # the stand-in answered the optimizer's wrappers
    assert out["compiled"] == 2.0 and out["real_after"] == "module"
    assert out["cache_forgotten"] is True and out["forwards"] is True and out["step_after"] is True
    from disttrain.config.no_dynamo import _KNOWN

    assert out["known"] == {
        "get_optimize_ddp_mode": _KNOWN["utils"]["get_optimize_ddp_mode"](),
        "clear_lru_cache": True,
        "OptimizedModule": True,
        "graph_break": True,
    }
