"""The suite's CLI runs stay on gloo CPU ranks on a CUDA machine too, unless a test is marked `gpu`."""

from __future__ import annotations

from .conftest import FAST, pinned_backend


def test_cli_runs_are_pinned_to_gloo_unless_they_choose_a_backend() -> None:
    assert pinned_backend(*FAST, "data=synthetic", "backend.timeout=5") == ("backend=gloo",)
    assert pinned_backend("backend=nccl") == ()
    assert pinned_backend("backend.name=auto") == ()
