"""Launcher checks before launch: a taken master_port (D23), launcher.monitor_interval (D21)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from unit_support import checked, checked_run, disttrain_in_process, said

from disttrain.config.errors import ConfigError
from disttrain.preflight import launch_checks


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def test_taken_master_port_is_named_before_launch(taken_port: int) -> None:
    cfg = checked_run([f"master_port={taken_port}"])
    with pytest.raises(ConfigError) as err:
        launch_checks.check_runtime(cfg)
    assert (err.value.key, err.value.value) == ("master_port", taken_port)
    assert "in use" in err.value.allowed and "master_port=0" in err.value.hint


def test_free_or_unset_port_passes(taken_port: int) -> None:
    launch_checks.check_runtime(checked_run([]))  # 0: a free one is picked at launch
    launch_checks.check_runtime(
        checked_run(["nodes=2", "node_rank=1", "master_addr=10.0.0.1", f"master_port={taken_port}"])
    )


def test_monitor_interval_must_be_positive() -> None:
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError) as err:
            checked([f"launcher.monitor_interval={bad}"])
        assert err.value.key == "launcher.monitor_interval"


def test_cli_taken_port_exit_2_no_run_dir(taken_port: int, scratch: Path) -> None:
    proc = disttrain_in_process("train", f"master_port={taken_port}", cwd=scratch)
    assert proc.returncode == 2, proc.stderr
    assert said(proc.stderr)[0].startswith(f"disttrain: config error: master_port={taken_port} is not valid")
    assert "Traceback" not in proc.stderr and list(scratch.iterdir()) == []
