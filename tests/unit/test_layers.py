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

from layer_graph import Import, all_imports, cycles, graph, imports, module_cycles, units, upward

LAYERS: dict[str, int] = {
    # 0. leaves: the config (compose, schema, errors, typed slices; with the torch-free plug-in
    #    declarations layer_graph.PLACED puts here), atomic file writes, object-store paths, start-up
    #    timing marks
    "config": 0,
    "safefile": 0,
    "storage": 0,  # s3:// and gs:// locations through fsspec (what a path is, in an object store)
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

# (unit, unit) pairs where the first may name a module of the second by string only (never import
# it), each with its reason. A plug-in declaration naming its own implementation needs no entry
# (`Import.own_implementation`).
NAMED: dict[tuple[str, str], str] = {
    ("launch", "worker"): "the rank's entry point: a launcher starts it as a process by its name",
    ("trust", "data"): "the data builders a foreign run dir may name (an allow-list of names)",
    ("trust", "models"): "the gpt tensor-parallel plan a foreign run dir may name (allow-list)",
    ("trust", "tasks"): "the Task base class a foreign run dir's task must derive from (allow-list)",
}

# Cycles between the modules of one unit that exist today, each with why and what would end it.
# A new one fails the test; one that goes must leave this table too.
KNOWN_MODULE_CYCLES: dict[str, str] = {
    # config/ with the plug-in declarations PLACED in it: errors.py names the schema and the
    # strategies for did-you-mean, the schema gathers the registries, the registries type their
    # configs (typed.py) and raise errors. Issue 39's Run typed to its leaves is where it ends.
    " ".join(
        sorted(
            [
                f"disttrain.config.{m}"
                for m in ("common", "errors", "extras", "instantiate", "registry", "run", "schema", "typed")
            ]
            + [
                "disttrain.data.specs",
                "disttrain.launch.base",
                "disttrain.launch.specs",
                "disttrain.models.parallel",
            ]
            + [f"disttrain.launch.specs.{m}" for m in ("k8s", "slurm", "spawn", "torchrun")]
            + ["disttrain.models.specs", "disttrain.strategies.specs", "disttrain.tasks.specs"]
            + [
                f"disttrain.strategies.specs.{m}"
                for m in ("core", "data_parallel", "model_parallel", "sharded")
            ]
        )
    ): "the config layer's declarations and checks",
}


def _allowed(i: Import) -> bool:
    return (
        (i.source, i.target) in ALLOWED
        or i.own_implementation
        or (i.by_name and (i.from_unit, i.to_unit) in NAMED)
    )


def _climbs(found: tuple[Import, ...]) -> list[Import]:
    return [i for i in upward(found, LAYERS) if not _allowed(i)]


def test_every_unit_has_a_layer() -> None:
    assert sorted(units() - set(LAYERS)) == [], "add the new package or module to LAYERS"
    assert sorted(set(LAYERS) - units()) == [], "LAYERS names a unit that is gone"


def test_no_import_climbs() -> None:
    climbing = _climbs(imports())
    assert not climbing, "imports that climb a layer:\n" + "\n".join(map(str, climbing))


def test_no_cycle_between_units() -> None:
    found = tuple(i for i in imports() if not _allowed(i))
    loops = cycles(graph(found))
    detail = [
        str(i)
        for c in loops
        for i in found
        if i.from_unit in c and i.to_unit in c and i.from_unit != i.to_unit
    ]
    assert not loops, f"import cycles: {loops}\n" + "\n".join(detail)


def test_no_new_cycle_inside_a_unit() -> None:
    found = {" ".join(c): c for c in module_cycles(all_imports())}
    assert sorted(set(found) - set(KNOWN_MODULE_CYCLES)) == [], "a new import cycle inside a unit"
    assert sorted(set(KNOWN_MODULE_CYCLES) - set(found)) == [], (
        "a known cycle is gone: drop it from the table"
    )


def test_config_is_a_leaf() -> None:
    """`config/` (and the declarations placed beside it) imports nothing above layer 0."""
    above = [i for i in imports() if i.from_unit == "config" and LAYERS[i.to_unit] > 0 and not _allowed(i)]
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


def test_the_checks_catch_a_load_by_name_and_a_cycle_inside_a_unit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`importlib.import_module("disttrain.launch.torchrun")` and a `"module:Name"` string climb as an
    import does (a docstring naming a module does not); two modules of one unit importing each
    other, one of them lazily, are a cycle."""
    package = tmp_path / "disttrain"
    for unit in ("config", "launch"):
        (package / unit).mkdir(parents=True)
        (package / unit / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "config" / "validate.py").write_text(
        '"""Not a load: disttrain.launch.torchrun."""\nimport importlib\n\n'
        'def check():\n    importlib.import_module("disttrain.launch.torchrun")\n\n'
        'TARGET = "disttrain.launch.slurm:SlurmLauncher"\n'
    )
    (package / "launch" / "torchrun.py").write_text("from disttrain.launch.slurm import SlurmLauncher\n")
    (package / "launch" / "slurm.py").write_text(
        "def SlurmLauncher():\n    from disttrain.launch import torchrun\n"
    )
    found = all_imports(package)
    assert [str(i) for i in upward(imports(package), LAYERS)] == [
        "disttrain/config/validate.py:5 disttrain.config.validate -> disttrain.launch.torchrun (by name)",
        "disttrain/config/validate.py:7 disttrain.config.validate -> disttrain.launch.slurm.SlurmLauncher (by name)",
    ]
    assert module_cycles(found, package) == [["disttrain.launch.slurm", "disttrain.launch.torchrun"]]


def test_hydra_private_names_live_in_one_module() -> None:
    """Issue 39: `hydra._internal`, Hydra's private methods and its process-wide singletons
    (`GlobalHydra`, `HydraConfig.instance()`'s `set_config`) are touched in config/hydra_private.py
    only (a Hydra upgrade that moves them breaks one module; the sweep's job runner sets none)."""
    from layer_graph import PACKAGE

    private = ("hydra._internal", "._query(", "split_arguments(", "get_args_parser(")
    private += ("GlobalHydra", "HydraConfig.instance(", "set_config(")
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "hydra_private.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if any(name in line for name in private)
    ]
    assert found == []


def test_the_rehearsals_private_torch_names_live_in_fake_world() -> None:
    """Issue 39: `plan --simulate` and `--load-at` import or call torch's private names through
    tools/fake_world.py only (read from the AST: prose may name them)."""
    import ast

    from layer_graph import PACKAGE

    def private(name: str) -> bool:
        return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))

    found = []
    for path in sorted((PACKAGE / "tools").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                names = [node.module or "", *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("torch")]
            elif isinstance(node, ast.Attribute) and node.attr in ("_get_root_mesh",):
                names = [node.attr]
            if any(private(n) for n in names) and path.name != "fake_world.py":
                found.append(f"{path.name}:{node.lineno} {names}")
    assert found == []
