"""One daemon per run directory: the run directory's lock (issue #30, 7)."""

import os
import subprocess
import sys

import pytest

from grpod.run.lock import LOCK_NAME, RunDirInUse, RunDirLock


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path):
    with RunDirLock(tmp_path) as first:
        assert first.held and (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())
        with pytest.raises(RunDirInUse) as caught:
            RunDirLock(tmp_path).acquire()
        assert caught.value.holder == os.getpid()
        assert f"in use by grpod pid {os.getpid()}" in str(caught.value) and "another run.dir" in str(caught.value)
    RunDirLock(tmp_path).acquire()  # released: the next one takes it


def test_the_kernel_releases_the_lock_of_a_killed_holder(tmp_path):
    """No stale lock: a SIGKILLed holder's lock goes with it, whatever its file says."""
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from grpod.run.lock import RunDirLock; RunDirLock(sys.argv[1]).acquire(); "
         "print('held', flush=True); time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirInUse, match=f"pid {holder.pid}"):
            RunDirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    lock = RunDirLock(tmp_path)
    lock.acquire()
    assert lock.held
    lock.release()


def test_children_do_not_inherit_the_lock(tmp_path):
    """vLLM and every other child: the descriptor is close-on-exec, so an orphan holds nothing."""
    with RunDirLock(tmp_path) as lock:
        assert not os.get_inheritable(lock._fd)
