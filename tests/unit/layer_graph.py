"""Every import inside `disttrain/` by package, read from the source (AST only, nothing imported).

A *unit* is a subpackage (`config`, `launch`, ...) or a top-level module (`worker`, `rundir`, ...).
Every `import` / `from ... import` counts: at module top, under `if TYPE_CHECKING:` and inside
functions (a lazy import is still a dependency: it only moves the cost to the first call). So does
every string that names a disttrain module the way code loads one later: `"disttrain.a.b"` (for
`importlib.import_module`) and `"disttrain.a.b:Name"` (the plug-in `impl`/`target` form), counted
as lazy imports. Docstrings are text, not loads.

    python tests/unit/layer_graph.py          # the package graph, its cycles, the upward imports

`test_layers.py` holds the layer table and asserts on `imports()`, `cycles()` and `upward()`.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "disttrain"


@dataclass(frozen=True)
class Import:
    """One import of a disttrain module by another, at `path:line`."""

    path: str  # relative to the repository root
    line: int
    source: str  # the importing module, dotted
    target: str  # the imported module (or module.name), dotted
    lazy: bool  # inside a function: runs on the first call, not at import
    by_name: bool = False  # a string naming the module, loaded later (import_module, a plug-in target)

    @property
    def from_unit(self) -> str:
        return unit_of(self.source)

    @property
    def to_unit(self) -> str:
        return unit_of(self.target)

    def __str__(self) -> str:
        how = " (by name)" if self.by_name else " (lazy)" if self.lazy else ""
        return f"{self.path}:{self.line} {self.source} -> {self.target}{how}"

    @property
    def own_implementation(self) -> bool:
        """A plug-in declaration (`PLACED`) naming its implementation in its own folder by string:
        the designed "declaration beside its code" (the registry imports it when a rank needs it)."""
        placed = self.source != unit_of(self.source) and self.from_unit != folder_of(self.source)
        return self.by_name and placed and folder_of(self.source) == folder_of(self.target)


# Modules that belong to a unit other than their folder's. A plug-in keeps its torch-free
# declaration beside its code (name, typed config, defaults, checks); the config schema gathers
# every declaration into the ConfigStore, so the declarations sit in the config layer and may import
# only that layer (config/, safefile, timing).
PLACED = {
    "disttrain.strategies.specs": "config",  # StrategySpec and each strategy's config class
    "disttrain.launch.specs": "config",  # LauncherSpec, LAUNCHERS: each launcher's name, config, detect()
    "disttrain.launch.registry": "config",  # the launcher of a config (launcher_for, launcher_config)
    "disttrain.tasks.specs": "config",  # TASKS: the built-in tasks' names and configs
    "disttrain.models.specs": "config",  # MODELS: the built-in models' names and configs
    "disttrain.data.specs": "config",  # DATA: the built-in data sets' names and configs
    "disttrain.launch.base": "config",  # the Launcher protocol a LauncherSpec loads (imports nothing)
    "disttrain.models.parallel": "config",  # the plan language the strategy specs check a model against
}


def unit_of(module: str) -> str:
    """`disttrain.config.schema` -> `config`; `disttrain.worker` -> `worker`; `disttrain` -> `disttrain`;
    a module under a `PLACED` prefix -> its placed unit."""
    for prefix, unit in PLACED.items():
        if module == prefix or module.startswith(prefix + "."):
            return unit
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def folder_of(module: str) -> str:
    """The unit `module` sits in on disk, whatever `PLACED` says: `disttrain.data.specs` -> `data`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module_name(path: Path, package: Path) -> tuple[str, str]:
    """(the module's dotted name, the package its relative imports start from)."""
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    package = ".".join(parts[:-1])
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts), package


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    # `from disttrain import checkpoint` names a subpackage: each imported name may be one.
    return [f"{module}.{alias.name}" for alias in node.names]


# A string naming a module to load: `disttrain.a.b` or `disttrain.a.b:Name`.
LOADED = re.compile(r"disttrain(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?")

Node = ast.Import | ast.ImportFrom | ast.Constant


def _walk(tree: ast.AST, lazy: bool = False) -> Iterable[tuple[Node, bool]]:
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, lazy
        elif isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant):
            continue  # a docstring (or a bare string): text
        elif (
            isinstance(child, ast.Constant) and isinstance(child.value, str) and LOADED.fullmatch(child.value)
        ):
            yield child, True
        inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _walk(child, inner)


def _loaded(node: Node, package: str) -> list[str]:
    if isinstance(node, ast.Constant):
        return [str(node.value).replace(":", ".")]
    return _targets(node, package)


def imports(package: Path = PACKAGE) -> tuple[Import, ...]:
    """Every import of one disttrain unit by another (imports within a unit are left out)."""
    return tuple(i for i in all_imports(package) if i.from_unit != i.to_unit)


def all_imports(package: Path = PACKAGE) -> tuple[Import, ...]:
    """Every import of a disttrain module by another, within a unit too."""
    return _read(package.resolve())


@lru_cache
def _read(package: Path) -> tuple[Import, ...]:
    found: list[Import] = []
    known = units(package)
    for path in sorted(package.rglob("*.py")):
        source, relative_to = _module_name(path, package)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, lazy in _walk(tree):
            for target in _loaded(node, relative_to):
                if target != "disttrain" and not target.startswith("disttrain."):
                    continue
                where = str(path.relative_to(package.parent))
                item = Import(where, node.lineno, source, target, lazy, isinstance(node, ast.Constant))
                # `from disttrain import __version__` and the like name the root package itself.
                if item.to_unit in known and item.target != item.source:
                    found.append(item)
    return tuple(found)


def modules(package: Path = PACKAGE) -> set[str]:
    """Every module's dotted name (a package by its own name)."""
    return {_module_name(path, package)[0] for path in package.rglob("*.py")}


def module_of(target: str, known: set[str]) -> str:
    """The module an import target names: `disttrain.config.errors.ConfigError` -> `disttrain.config.errors`."""
    while target not in known and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def module_cycles(found: Iterable[Import], package: Path = PACKAGE) -> list[list[str]]:
    """Cycles between the modules of one unit (`import` statements of any kind, string loads
    included): the unit-level test cannot see them."""
    known = modules(package)
    edges: dict[str, set[str]] = defaultdict(set)
    for item in found:
        target = module_of(item.target, known)
        # Importing a module runs its package's __init__ first: not an edge of the design.
        if (
            item.from_unit == item.to_unit
            and target != item.source
            and not item.source.startswith(target + ".")
        ):
            edges[item.source].add(target)
    return cycles(edges)


def units(package: Path = PACKAGE) -> set[str]:
    """Every unit: the subpackages and the top-level modules."""
    found = {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    found |= {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    return found


def graph(found: Iterable[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for item in found:
        edges[item.from_unit].add(item.to_unit)
    return edges


def cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one unit (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    nodes = set(edges) | {n for targets in edges.values() for n in targets}
    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return found


def upward(found: Iterable[Import], layer: Mapping[str, int]) -> list[Import]:
    """The imports whose target sits in a higher layer than their source (same layer is fine
    when no cycle joins the two; `cycles` catches those)."""
    return [item for item in found if layer[item.to_unit] > layer[item.from_unit]]


def main() -> int:
    found = tuple(i for i in imports() if not i.own_implementation)
    edges = graph(found)
    for source in sorted(edges):
        print(f"{source:12} -> {', '.join(sorted(edges[source]))}")
    print()
    loops = cycles(edges)
    for component in loops:
        print("cycle:", " ".join(component))
        members = set(component)
        for item in found:
            if item.from_unit in members and item.to_unit in members:
                print("   ", item)
    if not loops:
        print("no cycles")
    return 1 if loops else 0


if __name__ == "__main__":
    sys.exit(main())
