"""Fixtures for the unit tests; the helpers they share live in unit_support.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """An empty working directory for one CLI call (where a wrongly created runs/ would appear)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return cwd


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A real process group of one rank (gloo over an in-memory store), one thread as in CI's ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
