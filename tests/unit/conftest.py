"""Fixtures for the unit tests; the helpers they share live in unit_support.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


# The reviews' GPT-2 (save_pretrained, no hub): 35,712 parameters.
TINY_GPT2 = {"vocab_size": 256, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 2}


@pytest.fixture(scope="session")
def saved_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`saved_gpt2(**config)`: the folder of a GPT-2 of that config (weights from seed 0) written by
    save_pretrained, once per config for the session. It is shared: a test that changes or removes
    it works on a copy (shutil.copytree)."""
    transformers = pytest.importorskip("transformers")
    made: dict[tuple[tuple[str, Any], ...], Path] = {}

    def folder(**config: Any) -> Path:
        key = tuple(sorted(config.items()))
        if key not in made:
            path = tmp_path_factory.mktemp("gpt2") / "tiny"
            with torch.random.fork_rng(devices=[]):  # the session's RNG stays as it was
                torch.manual_seed(0)
                transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).save_pretrained(path)
            made[key] = path
        return made[key]

    return folder


@pytest.fixture(scope="session")
def tiny_gpt2(saved_gpt2: Callable[..., Path]) -> Path:
    """The reviews' GPT-2 (TINY_GPT2) in a save_pretrained folder; shared (copy it to change it)."""
    return saved_gpt2(**TINY_GPT2)
