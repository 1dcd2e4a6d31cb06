import os
import socket
import time

from grpod.service.notify import Heartbeat, SystemdNotifier, watchdog_interval_s


def _listener(path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    return sock


def test_notify_datagrams_reach_the_socket(tmp_path):
    path = tmp_path / "notify.sock"
    with _listener(path) as sock:
        notifier = SystemdNotifier(str(path))
        assert notifier.ready("vLLM ready")
        assert sock.recv(4096) == b"READY=1\nSTATUS=vLLM ready"
        notifier.watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"
        notifier.stopping("bye")
        assert sock.recv(4096) == b"STOPPING=1\nSTATUS=bye"
        notifier.close()


def test_abstract_socket_address():
    name = f"grpod-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        SystemdNotifier("@" + name).status("hello")
        assert sock.recv(4096) == b"STATUS=hello"


def test_disabled_without_notify_socket(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = SystemdNotifier()
    assert not notifier.enabled
    assert notifier.watchdog() is False


def test_watchdog_interval(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval_s() == 2.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert watchdog_interval_s() is None


def test_heartbeat_stops_when_work_hangs():
    hb = Heartbeat(stall_after_s=0.2)
    assert hb.healthy()
    hb.busy()
    assert hb.healthy()
    time.sleep(0.3)
    assert not hb.healthy(), "a step running past stall_after_s must withhold the heartbeat"
    hb.progress()
    assert hb.healthy()


def test_heartbeat_counts_work_running_beside_the_step_loop():
    """A pipelined sync hanging in the background withholds the heartbeat even while the step
    loop itself finishes its units of work (or waits for rollouts, which is not a stall)."""
    hb = Heartbeat(stall_after_s=0.2)
    with hb.running():
        hb.busy()
        hb.progress()  # the step loop moves on
        assert hb.healthy()
        time.sleep(0.3)
        assert not hb.healthy() and hb.describe()["busy_for_s"] >= 0.3
    assert hb.healthy() and hb.describe()["busy_for_s"] is None
