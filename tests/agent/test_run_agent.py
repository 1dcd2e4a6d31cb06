"""`grpod agent` as a process: it refuses to start without a token or with engines that would face
the network without an API key (exit 2, the key named), tells systemd READY=1 once its API
listens, answers with the token, and exits 0 on SIGTERM (STOPPING=1)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

from grpod.inference.release import free_port
from tests.agent.conftest import TOKEN
from tests.harness import ROOT, write_config


def _agent(config, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "grpod", "agent", "--config", str(config)], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_no_token_no_agent(tmp_path):
    proc = _agent(write_config(tmp_path / "agent.toml", {"run.dir": str(tmp_path / "run"), "agent.port": 7999}))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "agent.token (or agent.token_file) is required" in err, err


def test_engines_on_a_routable_address_need_the_api_key(tmp_path):
    settings = {"run.dir": str(tmp_path / "run"), "agent.token": TOKEN, "inference.host": "10.1.2.3"}
    proc = _agent(write_config(tmp_path / "agent.toml", settings))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "inference.api_key is not set" in err, err


def test_a_token_file_that_cannot_be_read_is_named(tmp_path):
    settings = {"run.dir": str(tmp_path / "run"), "agent.token_file": str(tmp_path / "missing.token")}
    proc = _agent(write_config(tmp_path / "agent.toml", settings))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "agent.token_file" in err and "missing.token" in err, err


def test_ready_status_and_sigterm(tmp_path):
    token_file = tmp_path / "agent.token"
    token_file.write_text(TOKEN + "\n")
    port = free_port("127.0.0.1")
    settings = {"run.dir": str(tmp_path / "run"), "agent.token_file": str(token_file), "agent.port": port,
                "agent.engines": 2}
    notify = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(notify))
        sock.settimeout(120)
        proc = _agent(write_config(tmp_path / "agent.toml", settings), env={"NOTIFY_SOCKET": str(notify)})
        try:
            ready = sock.recv(4096).decode()
            assert "READY=1" in ready and f"127.0.0.1:{port}" in ready, ready
            request = urllib.request.Request(f"http://127.0.0.1:{port}/status", headers={"Authorization": f"Bearer {TOKEN}"})
            with urllib.request.urlopen(request, timeout=30) as answer:
                status = json.loads(answer.read())
            assert [e["name"] for e in status["engines"]] == ["engine-0", "engine-1"] and status["pid"] == proc.pid
            assert all(not e["running"] for e in status["engines"]), "an agent alone launches nothing"
            proc.send_signal(signal.SIGTERM)
            assert "STOPPING=1" in sock.recv(4096).decode()
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    assert (tmp_path / "run" / "agent" / "grpod.log").exists()
