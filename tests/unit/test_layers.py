"""The package's layers: an import may go down the table or stay in its layer, never climb, and no
two units import each other, even lazily (inside a function) or only for type hints.

Read from the source (`layer_graph.py`, AST only): nothing is imported, the test takes milliseconds.
`python tests/unit/layer_graph.py` prints the graph and its cycles.

The order follows what the code needs, from the bottom up. `config` is the bottom: every layer reads
a typed config and raises a `ConfigError`. The run dir and a rank's place in the world come next:
files and environment variables, no model. `observe` logs and records for everything above it. The
run's parts (data, models, tasks) know nothing of how they are distributed; a strategy wraps them
(precision is part of the strategy's wrapping); a checkpoint stores a strategy's state dicts; the
engine drives strategy, task, data and checkpoints. `launch` starts the ranks (and reads what the
engine's hang watch left). `preflight` checks a config by building what a rank would build, so it
sits above everything it builds, below the entry points: `worker` (a rank) and the commands.
"""

from __future__ import annotations

from layer_graph import Import, cycles, graph, imports, units, upward

LAYERS: dict[str, int] = {
    # 0. leaves: the config (compose, schema, errors, typed slices; with the torch-free plug-in
    #    declarations layer_graph.PLACED puts here), atomic file writes, start-up timing marks
    "config": 0,
    "safefile": 0,
    "timing": 0,
    "traps": 0,
    # 1. the run dir's files (claim, freeze, owner, signature, shared checkpoint dir, a sweep's record), where this
    #    rank stands (rank, world, device, process group), its RNGs and the processes /proc shows:
    #    files and environment, no model
    "trust": 1,
    "owner": 1,
    "rundir": 1,
    "sweepdir": 1,
    "shared_dir": 1,
    "procs": 1,
    "dist": 1,
    "rng": 1,
    # 2. logs, metrics, progress, profiler, throughput, the environment report
    "observe": 2,
    # 3. the run's parts, unaware of distribution: data sets and loaders, models, tasks
    "data": 3,
    "models": 3,
    "tasks": 3,
    # 4. how a model is distributed and in what precision
    "strategies": 4,
    # 5. storage of a strategy's state dicts, and what goes into a checkpoint when
    "checkpoint": 5,
    # 6. the loop over strategy, task, data and checkpoints
    "engine": 6,
    # 7. starting ranks: torchrun, spawn, slurm, k8s, the fork server, first failing rank
    "launch": 7,
    # 8. the parent's checks before launch: static, then the meta build and the dry step
    "preflight": 8,
    # 9. the per-rank composition roots: train (`worker`), eval and predict (`eval_worker`)
    "worker": 9,
    "eval_worker": 9,
    # 10. the commands and tools the CLI dispatches to; the fault-injection model of the tests
    "commands": 10,
    "tools": 10,
    "testing": 10,
    # 11. the entry points
    "cli": 11,
    "__main__": 11,
}

# (importing module, imported module) pairs allowed to climb, each with its reason. Keep it empty.
ALLOWED: dict[tuple[str, str], str] = {}


def _climbs(found: tuple[Import, ...]) -> list[Import]:
    return [i for i in upward(found, LAYERS) if (i.source, i.target) not in ALLOWED]


def test_every_unit_has_a_layer() -> None:
    assert sorted(units() - set(LAYERS)) == [], "add the new package or module to LAYERS"
    assert sorted(set(LAYERS) - units()) == [], "LAYERS names a unit that is gone"


def test_no_import_climbs() -> None:
    climbing = _climbs(imports())
    assert not climbing, "imports that climb a layer:\n" + "\n".join(map(str, climbing))


def test_no_cycle_between_units() -> None:
    found = imports()
    loops = cycles(graph(found))
    detail = [
        str(i)
        for c in loops
        for i in found
        if i.from_unit in c and i.to_unit in c and i.from_unit != i.to_unit
    ]
    assert not loops, f"import cycles: {loops}\n" + "\n".join(detail)


def test_config_is_a_leaf() -> None:
    """`config/` (and the declarations placed beside it) imports nothing above layer 0."""
    above = [i for i in imports() if i.from_unit == "config" and LAYERS[i.to_unit] > 0]
    assert not above, "\n".join(map(str, above))


def test_the_checks_catch_a_climbing_import(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The two rules fail on a lazy import from a lower layer to a higher one."""
    package = tmp_path / "disttrain"
    for unit in ("config", "launch"):
        (package / unit).mkdir(parents=True)
        (package / unit / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "config" / "validate.py").write_text(
        "def check():\n    from disttrain.launch import torchrun\n"
    )
    (package / "launch" / "run.py").write_text("from disttrain.config import validate\n")
    found = imports(package)
    assert [str(i) for i in upward(found, LAYERS)] == [
        "disttrain/config/validate.py:2 disttrain.config.validate -> disttrain.launch.torchrun (lazy)"
    ]
    assert cycles(graph(found)) == [["config", "launch"]]
