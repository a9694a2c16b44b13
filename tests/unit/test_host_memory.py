"""disttrain.observe.host_memory: a rank's peak resident memory, reset when training starts."""

from __future__ import annotations

import sys

import pytest

from disttrain.observe import host_memory

MIB = 2**20


@pytest.mark.skipif(sys.platform != "linux", reason="VmHWM and clear_refs are Linux's")
def test_the_peak_follows_memory_touched_and_resets_to_what_is_resident() -> None:
    """64 MiB touched raise the peak by about 64 MiB; once freed, reset_peak brings the peak back
    down to what the process holds now (a rank forked from a larger fork server starts there)."""
    host_memory.reset_peak()
    before = host_memory.peak_bytes()
    block = bytearray(64 * MIB)
    block[::4096] = b"\1" * len(range(0, len(block), 4096))  # touch every page: resident
    assert host_memory.peak_bytes() - before > 60 * MIB
    del block
    high = host_memory.peak_bytes()
    host_memory.reset_peak()
    assert host_memory.peak_bytes() < high - 50 * MIB
