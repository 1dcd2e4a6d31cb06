"""A child that leads its own process group (grpod's vLLM server) stops with the process that
started it: real processes, a real SIGKILL of the parent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from grpod.inference.release import group_members

# The child: watches its parent, starts a grandchild in its own group, says its pid and the
# grandchild's, then waits. With "ignore", SIGTERM does nothing (a server too busy to stop).
CHILD = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    from grpod.service.children import stop_group_with_parent
    stop_group_with_parent()
    if sys.argv[1] == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(json.dumps([os.getpid(), grandchild.pid]), flush=True)
    time.sleep(600)
""")

# The parent: starts the child in a session of its own, as InferenceProcess starts vLLM, passes
# on what the child printed, then waits to be killed.
PARENT = textwrap.dedent("""
    import subprocess, sys, os, time
    from grpod.service.children import parent_env
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE,
                             env={**os.environ, **parent_env(float(sys.argv[3]))}, start_new_session=True)
    print(child.stdout.readline().decode().strip(), flush=True)
    time.sleep(600)
""")

ROOT = Path(__file__).resolve().parents[2]


def _family(mode: str, grace_s: float) -> tuple[subprocess.Popen, int, int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, mode, str(grace_s)], stdout=subprocess.PIPE,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    child, grandchild = json.loads(parent.stdout.readline())
    return parent, child, grandchild


def _gone_within(pgid: int, timeout_s: float) -> float:
    started = time.monotonic()
    while group_members(pgid):
        assert time.monotonic() - started < timeout_s, f"group {pgid} still alive: {group_members(pgid)}"
        time.sleep(0.05)
    return time.monotonic() - started


def test_the_group_stops_on_sigterm_once_the_parent_is_killed():
    parent, child, grandchild = _family("default", grace_s=30.0)
    try:
        assert os.getpgid(child) == child and os.getpgid(grandchild) == child
        time.sleep(1.0)  # two of the watcher's polls: nothing happens while the parent lives
        assert {p.pid for p in group_members(child)} == {child, grandchild}
        parent.kill()
        parent.wait(timeout=10)
        # SIGTERM to the group ends both well before the grace would have run out.
        assert _gone_within(child, 20.0) < 20.0
    finally:
        _cleanup(parent, child)


def test_a_child_that_ignores_sigterm_is_killed_with_its_group_after_the_grace():
    parent, child, grandchild = _family("ignore", grace_s=2.0)
    try:
        parent.kill()
        parent.wait(timeout=10)
        elapsed = _gone_within(child, 15.0)
        assert elapsed >= 1.5, f"killed after {elapsed:.2f} s: before the grace"
    finally:
        _cleanup(parent, child)


def test_a_child_whose_parent_is_gone_before_it_watches_exits_at_once():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRPOD_PARENT_PID": "1" if os.getppid() != 1 else "2"}
    code = subprocess.run([sys.executable, "-c", "from grpod.service.children import stop_group_with_parent as s; "
                           "s(); print('went on')"], env=env, capture_output=True, timeout=60)
    assert code.returncode == 1 and b"went on" not in code.stdout


def _cleanup(parent: subprocess.Popen, pgid: int) -> None:
    if parent.poll() is None:
        parent.kill()
        parent.wait(timeout=10)
    if group_members(pgid):
        os.killpg(pgid, signal.SIGKILL)
