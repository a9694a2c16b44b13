"""tests/conftest.py's LONGEST_FIRST names test modules that exist (a renamed one would silently
lose its place at the front of the CI queue)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_longest_first_names_existing_modules_once() -> None:
    tree = ast.parse((TESTS / "conftest.py").read_text())
    names = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "LONGEST_FIRST"
    )
    assert len(names) == len(set(names)), names
    missing = [name for name in names if not (TESTS / name).is_file()]
    assert not missing, f"LONGEST_FIRST names modules that do not exist: {missing}"
