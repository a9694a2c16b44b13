"""Ranks and launcher run torch as installed (issue 25): nothing in disttrain/ swaps a module in
sys.modules or assigns, deletes or setattr()s an attribute of torch or of anything imported from it.
A patch there changes torch for every caller in the process (a user's model, torch.compile), far
from the line that made it; an override belongs in a subclass or a parameter of disttrain's own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import disttrain

PACKAGE = Path(disttrain.__file__).parent


def _torch_names(tree: ast.Module) -> set[str]:
    """The names a module binds to torch or to something imported from it (`import torch`,
    `import torch.x as t`, `from torch.x import y`), anywhere in the file (function-level imports too)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_torch(alias.name):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_torch(node.module or ""):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _is_torch(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_sys_modules(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "modules" and _root(node) == "sys"


def patches(source: str) -> list[str]:
    """`line: what` for each patch of torch or of sys.modules in `source`."""
    tree = ast.parse(source)
    torch_names = _torch_names(tree)
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            if node.func.id in ("setattr", "delattr") and _root(node.args[0]) in torch_names:
                found.append(f"{node.lineno}: {node.func.id}({ast.unparse(node.args[0])}, ...)")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and _is_sys_modules(node.func.value)
            and node.func.attr in ("__setitem__", "update", "setdefault")
        ):
            found.append(f"{node.lineno}: {ast.unparse(node.func)}(...)")
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                swapped_module = isinstance(t, ast.Subscript) and _is_sys_modules(t.value)
                if swapped_module or (
                    isinstance(t, (ast.Attribute, ast.Subscript)) and _root(t) in torch_names
                ):
                    found.append(f"{node.lineno}: {ast.unparse(t)}")
    return found


def test_the_checker_finds_each_kind_of_patch() -> None:
    source = """
import sys
import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
sys.modules["torch._dynamo"] = object()
del sys.modules["torch._dynamo"]
sys.modules.setdefault("x", None)
torch._dynamo = None
def f():
    from torch.optim import Optimizer
    Optimizer.add_param_group = None
    dynamic_rendezvous._delay = lambda s: None
    dist.init_process_group.__doc__ += "x"
    setattr(torch, "x", 1)
    delattr(dynamic_rendezvous, "get_method_name")
"""
    lines = sorted((p.split(":")[0] for p in patches(source)), key=int)
    assert lines == ["6", "7", "8", "9", "12", "13", "14", "15", "16"], patches(source)
    harmless = """
import sys, torch
x = sys.modules["torch"]
model: torch.nn.Module = torch.nn.Linear(2, 2)
model.weight.requires_grad = False  # a tensor of ours, not torch's
class Opt(torch.optim.SGD):
    add_param_group = torch.optim.SGD.add_param_group
"""
    assert patches(harmless) == []


def test_no_module_of_disttrain_patches_torch_or_sys_modules() -> None:
    found = {
        str(path.relative_to(PACKAGE.parent)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if (hits := patches(path.read_text()))
    }
    assert found == {}
    # The acceptance line of issue 25, literally: no `sys.modules[...] =` in any file of the package.
    literal = re.compile(r"sys\.modules\[[^\]]*\]\s*=[^=]")
    assert [p for p in PACKAGE.rglob("*.py") if literal.search(p.read_text())] == []
