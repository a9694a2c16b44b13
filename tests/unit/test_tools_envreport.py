"""Environment report traps, pure (no processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from unit_support import disttrain_in_process

from disttrain.traps import check_traps, ifname_matches

NAMES = ["lo", "eth0", "eth1", "ib0"]
BASE = {"cpu_count": 8, "cpu_affinity": 8, "interfaces": [{"name": n} for n in NAMES], "shm_bytes": 8 << 30}


def test_ifname_semantics_follow_nccl() -> None:
    assert ifname_matches("eth", NAMES) == (["eth0", "eth1"], [])  # prefix
    assert ifname_matches("=eth", NAMES) == ([], ["eth"])  # exact
    assert ifname_matches("^lo,ib", NAMES) == (["eth0", "eth1"], [])  # exclusion
    assert ifname_matches("ens5,eth0", NAMES) == (["eth0"], ["ens5"])


def test_known_traps_are_named_with_a_fix() -> None:
    env = {
        "OMP_NUM_THREADS": "8",
        "LOCAL_WORLD_SIZE": "4",
        "NCCL_SOCKET_IFNAME": "ens5",
        "NCCL_IB_DISABLE": "1",
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "no-such-host.invalid",
    }
    warnings = check_traps({**BASE, "shm_bytes": 64 << 20}, env, in_rank=False)
    text = "\n".join(warnings)
    assert "OMP_NUM_THREADS=8 x 4 local ranks = 32 threads on 8 cores" in text
    assert "NCCL_SOCKET_IFNAME=ens5" in text and "lo, eth0, eth1, ib0" in text
    assert "NCCL_IB_DISABLE=1" in text
    assert "/dev/shm is 64 MiB" in text
    assert "RANK=0 and WORLD_SIZE=2" in text
    assert "MASTER_ADDR=no-such-host.invalid" in text
    assert all("HINT" in w for w in warnings)
    # inside a launched rank RANK/WORLD_SIZE are expected
    assert not any("RANK=0" in w for w in check_traps(BASE, env, in_rank=True))


def test_a_clean_environment_has_no_warnings() -> None:
    assert (
        check_traps(BASE, {"OMP_NUM_THREADS": "2", "LOCAL_WORLD_SIZE": "4", "NCCL_SOCKET_IFNAME": "eth"})
        == []
    )


def test_env_command_json_and_help_stays_torch_free(tmp_path: Path) -> None:
    import json

    out = disttrain_in_process("env", "--json", cwd=tmp_path)  # `python -m disttrain`: test_cli_conventions
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert {"python", "torch", "gpus", "backends", "interfaces", "variables", "warnings"} <= set(report)
    code = "import sys; from disttrain.cli import main; main(['--help']); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, check=True)
