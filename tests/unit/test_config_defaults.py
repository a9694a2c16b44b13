"""A schema dataclass is the only home of a default: no `.get("<schema key>", <default>)` in the package.

After `resolve` every schema key is present (the structured merge fills its default), so code reads
`cfg["key"]` or the typed object (`typed(TrainerConfig, cfg["trainer"])`). A second spelling of the
default drifts (issue 15: `localsgd sync_every` was 4 in the schema and 1 in the code). Open
`_target_` nodes that may lack a key are typed by `config.common.Keyed.of`, whose fields take the schema's.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import disttrain
from disttrain.config import schema
from disttrain.launch.registry import launcher_specs
from disttrain.strategies import specs

PACKAGE = Path(disttrain.__file__).parent

# (file under disttrain/, key): reads that may name a default, and why it is not the schema's.
ALLOWED = {
    # An error message names the nested node's `_target_`, else its parent spec's.
    ("config/instantiate.py", "_target_"),
    # `time` of a checkpoint's meta JSON (data read from disk), not launcher.time.
    ("launch/errors.py", "time"),
    # torch.optim.SGD's own default for a swapped `optim._target_` (a clean node), not SGDConfig's 0.9.
    ("tools/planner.py", "momentum"),
}


def schema_keys_with_defaults() -> set[str]:
    classes = {v for v in vars(schema).values() if isinstance(v, type) and dataclasses.is_dataclass(v)}
    classes |= {spec.config for spec in specs.all()} | {spec.config for spec in launcher_specs()}
    keys = set()
    for cls in classes:
        for f in dataclasses.fields(cls):
            has = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if has and f.default != "???":  # OmegaConf's MISSING: a required key
                keys.add(f.name)
    return keys


def _get_key(node: ast.AST) -> str | None:
    """The literal key of a `<x>.get("key", ...)` call, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"):
        return None
    first = node.args[0] if node.args else None
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def defaulted_reads(source: str) -> list[tuple[int, str]]:
    """(line, key) of `.get("key", DEFAULT)` and `.get("key") or LITERAL` in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        key = _get_key(node)
        if key is not None and isinstance(node, ast.Call) and len(node.args) > 1:
            found.append((node.lineno, key))
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            key = _get_key(node.values[0])
            literal = (ast.Constant, ast.List, ast.Dict, ast.Tuple)
            if key is not None and any(isinstance(v, literal) for v in node.values[1:]):
                found.append((node.lineno, key))
    return found


def test_no_schema_default_is_restated_in_a_get() -> None:
    keys = schema_keys_with_defaults()
    assert {"resume", "scale_lr", "warmup_steps", "min_lr_ratio", "threads_per_rank", "gpu_mem_gb"} <= keys
    offenders, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for line, key in defaulted_reads(path.read_text()):
            if key not in keys:
                continue
            if (rel, key) in ALLOWED:
                used.add((rel, key))
            else:
                offenders.append(f"disttrain/{rel}:{line}: .get({key!r}, ...)")
    assert not offenders, (
        "a schema key read with a restated default (read cfg[key] or the typed object after resolve; "
        "an open `_target_` node: a Keyed block):\n" + "\n".join(offenders)
    )
    assert used == ALLOWED, f"stale allow-list entries: {sorted(ALLOWED - used)}"


@pytest.mark.parametrize(
    "source",
    ['cfg.get("resume", "auto")', 'cfg["plan"].get("gpu_mem_gb") or 80.0', 'x.get("warmup_steps", 0)'],
)
def test_the_scan_sees_both_spellings(source: str) -> None:
    assert len(defaulted_reads(source)) == 1


def test_keyed_blocks_take_the_schema_default_only_when_the_key_is_absent() -> None:
    assert schema.Optim.of({"_target_": "x.Y", "scale_lr": "linear"}).scale_lr == "linear"
    assert schema.Optim.of({"_target_": "x.Y"}).scale_lr == schema.OptimConfig.scale_lr == "none"
    assert schema.Sched.of({"name": "cosine"}).min_lr_ratio == schema.CosineSchedConfig.min_lr_ratio == 0.0
    assert schema.Sched.of({"name": "cosine"}).warmup_steps == schema.SchedConfig.warmup_steps == 0
    assert schema.Data.of({}).num_features is None  # required (???): no default to take


def test_a_targets_own_argument_named_target_stays_its_argument() -> None:
    """The clean-clone CI (test_data_streams' data=hf job): `task.target=labels`, lm's own argument,
    was taken for the TaskTarget's field (whose key is `_target_`) and dropped, so the task read
    the default field `y` and the dry step refused the run."""
    task = schema.TaskTarget.of(
        {"_target_": "disttrain.tasks.LanguageModel", "inputs": "input_ids", "target": "labels"}
    )
    assert task.target == "disttrain.tasks.LanguageModel"
    assert dict(task.kwargs) == {"inputs": "input_ids", "target": "labels"}
    assert "_partial_" not in schema.TaskTarget.of({"_target_": "x.f", "_partial_": True, "a": 1}).kwargs
