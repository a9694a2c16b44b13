"""Fixtures for the unit tests; the helpers they share live in unit_support.py."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """An empty working directory for one CLI call (where a wrongly created runs/ would appear)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return cwd
