"""Waiting for a child's GPU memory to be released (`grpod.inference.release`, what a relaunch
of vLLM waits on): NVML attributes the memory to the child's pid, the wait times out with an
error naming the pid and the MiB while the child holds it, and returns soon after it exits."""

from __future__ import annotations

import subprocess
import sys
import time

import anyio
import pytest

from grpod.inference.release import ReleaseTimeoutError, gpu_memory_held, wait_gpu_memory_released
from tests.gpu.conftest import read_line, stop_child

HOLD_MIB = 512
# The child allocates, says so, and holds the memory until its stdin closes.
HOLDER = f"""
import sys, torch
block = torch.empty({HOLD_MIB} << 20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("held", flush=True)
sys.stdin.read()
"""
RELEASE_BOUND_S = 30.0


def test_release_wait_times_out_while_held_and_returns_once_the_child_exits():
    """While the child holds 512 MiB, `wait_gpu_memory_released` raises `ReleaseTimeoutError`
    (pid and MiB in the message) after its 1 s timeout; once the child's stdin closes (it exits),
    the same wait returns within `RELEASE_BOUND_S`."""
    child = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert read_line(child).strip() == "held"
        held = gpu_memory_held([child.pid])
        assert held >= HOLD_MIB << 20, (
            f"NVML attributes {held} B to pid {child.pid}, which holds {HOLD_MIB} MiB: on this machine NVML "
            "does not see the process (a PID namespace?) and grpod's release wait would check nothing"
        )
        began = time.perf_counter()
        with pytest.raises(ReleaseTimeoutError, match=rf"GPU memory of processes \[{child.pid}\]: \d+ MiB still held after 1 s"):
            anyio.run(wait_gpu_memory_released, [child.pid], 1.0)
        timed_out_after = time.perf_counter() - began

        async def release_and_wait() -> float:
            child.stdin.close()  # the child exits
            began = time.perf_counter()
            await wait_gpu_memory_released([child.pid], RELEASE_BOUND_S)
            return time.perf_counter() - began

        released_after = anyio.run(release_and_wait)
    finally:
        code = stop_child(child)
    print(f"\nheld {held / 2**20:.0f} MiB by NVML; timed out after {timed_out_after:.2f} s; "
          f"released {released_after:.2f} s after the child's stdin closed; exit code {code}")
    assert code == 0
    assert gpu_memory_held([child.pid]) == 0
