"""Supervisor pieces that need no vLLM: the watchdog heartbeat tied to training progress."""

import os
import socket

import anyio

from grpod.config import load_config
from grpod.daemon.notify import SystemdNotifier
from grpod.daemon.supervisor import Daemon


def test_watchdog_pings_only_while_steps_progress(tmp_path, monkeypatch):
    path = tmp_path / "notify.sock"
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # ping every 50 ms
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    daemon = Daemon(load_config(None, [f"run.dir={str(tmp_path / 'run')!r}", "notify.stall_after_s=0.3"]))
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.setblocking(False)
        daemon.notifier = SystemdNotifier(str(path))

        def drain() -> int:
            count = 0
            while True:
                try:
                    count += sock.recv(4096) == b"WATCHDOG=1"
                except BlockingIOError:
                    return count

        async def main():
            async with anyio.create_task_group() as tg:
                tg.start_soon(daemon._watchdog)
                await anyio.sleep(0.4)
                healthy = drain()
                daemon.heartbeat.busy()  # a step starts ... and hangs
                await anyio.sleep(0.35)
                drain()
                await anyio.sleep(0.4)
                hung = drain()
                daemon.heartbeat.progress()  # the step finally completes
                await anyio.sleep(0.3)
                recovered = drain()
                tg.cancel_scope.cancel()
            return healthy, hung, recovered

        healthy, hung, recovered = anyio.run(main)
    assert healthy >= 4
    assert hung == 0, "a step running past notify.stall_after_s must stop WATCHDOG=1"
    assert recovered >= 3
    assert daemon.status()["heartbeat"]["last_heartbeat_age_s"] is not None
