"""Release waits on real processes, sockets and /dev/shm files."""

from __future__ import annotations

import mmap
import os
import platform
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import anyio
import psutil
import pytest

from grpod.inference.release import (
    ReleaseTimeoutError,
    free_port,
    group_members,
    port_is_free,
    remove_shm_segments,
    vllm_shm_segments,
    wait_group_gone,
    wait_port_free,
)


def test_port_is_free_tracks_a_listener():
    port = free_port("127.0.0.1")
    assert port_is_free("127.0.0.1", port)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        assert not port_is_free("127.0.0.1", port)
    assert port_is_free("127.0.0.1", port)


@pytest.mark.anyio
async def test_wait_port_free_names_the_port_on_timeout():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ReleaseTimeoutError, match=f"port {port} on 127.0.0.1"):
            await wait_port_free("127.0.0.1", port, 0.3)


@pytest.mark.anyio
async def test_wait_group_gone_names_the_survivors_then_returns_once_killed():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        assert [p.pid for p in group_members(sleeper.pid)] == [sleeper.pid]
        with pytest.raises(ReleaseTimeoutError, match=f"process group {sleeper.pid}: processes {sleeper.pid} "):
            await wait_group_gone(sleeper.pid, 0.3)
        os.killpg(sleeper.pid, signal.SIGKILL)
        # Not reaped yet: a zombie counts as gone.
        await wait_group_gone(sleeper.pid, 5)
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)


# The main thread ends alone (exit(2), not exit_group) while another thread runs until told to end.
MAIN_THREAD_EXITS_FIRST = """
import ctypes, os, platform, sys, threading
def finish():
    sys.stdin.read()
    os._exit(0)
threading.Thread(target=finish).start()
ctypes.CDLL(None).syscall({"x86_64": 60, "aarch64": 93}[platform.machine()], 0)
"""


@pytest.mark.anyio
@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="the child needs exit(2)'s number")
async def test_a_zombie_whose_threads_still_run_is_a_member_until_they_end():
    child = subprocess.Popen([sys.executable, "-c", MAIN_THREAD_EXITS_FIRST], stdin=subprocess.PIPE,
                             start_new_session=True)
    try:
        proc = psutil.Process(child.pid)
        with anyio.fail_after(30):
            while proc.status() != psutil.STATUS_ZOMBIE:
                await anyio.sleep(0.01)
        assert child.poll() is None, "a zombie whose threads still run cannot be reaped yet"
        assert [p.pid for p in group_members(child.pid)] == [child.pid]
        child.stdin.close()
        await wait_group_gone(child.pid, 10)
        assert child.wait(timeout=10) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


def test_only_vllm_named_segments_mapped_by_the_process_are_leftovers():
    tag = uuid.uuid4().hex[:8]
    vllm_segment = Path(f"/dev/shm/psm_grpodtest{tag}")
    weights = Path(f"/dev/shm/grpod-test-weights-{tag}")
    unmapped = Path(f"/dev/shm/psm_grpodtest{tag}-unmapped")
    for path in (vllm_segment, weights, unmapped):
        path.write_bytes(b"\0" * mmap.PAGESIZE)
    mapper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import mmap, sys, time\n"
            "files = [open(p, 'r+b') for p in sys.argv[1:]]\n"
            "maps = [mmap.mmap(f.fileno(), 0) for f in files]\n"
            "print('mapped', flush=True)\n"
            "time.sleep(600)\n",
            str(vllm_segment),
            str(weights),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert mapper.stdout.readline().strip() == b"mapped"
        found = vllm_shm_segments([psutil.Process(mapper.pid)])
        assert found == {vllm_segment}
        assert remove_shm_segments(found) == [vllm_segment]
        assert not vllm_segment.exists() and weights.exists() and unmapped.exists()
        assert remove_shm_segments(found) == []
    finally:
        mapper.kill()
        mapper.wait(timeout=10)
        for path in (vllm_segment, weights, unmapped):
            path.unlink(missing_ok=True)


@pytest.mark.anyio
async def test_waits_do_not_block_the_event_loop():
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.02)

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            with pytest.raises(ReleaseTimeoutError):
                await wait_port_free("127.0.0.1", sock.getsockname()[1], 0.5)
            tg.cancel_scope.cancel()
    assert ticks >= 10
