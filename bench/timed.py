"""A `grpod start` run for a fixed wall time, as a user stops one: the benchmarks that measure
what a run reaches in M minutes from launch share it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def ctl(socket: Path, cmd: str, timeout_s: float = 120) -> dict[str, Any]:
    """`grpod ctl CMD --json` against `socket`: the daemon's reply, or {"ok": false, "error": ...}
    with what the command printed when there was none."""
    done = subprocess.run([sys.executable, "-m", "grpod", "ctl", cmd, "--json", "--socket", str(socket),
                           "--timeout", str(timeout_s)], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s + 30)
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"ok": False, "error": (done.stdout + done.stderr)[-500:]}


def run_for(config: Path, overrides: list[str], minutes: float, run_dir: Path, log: Path) -> dict[str, Any]:
    """`grpod start --config CONFIG --set ...` for `minutes` from launch, then `ctl stop` (the run's
    end-of-run evaluation and checkpoint follow) and wait for it to exit. RuntimeError when it
    exits before the time is up. Returns {launched, stopped, status: `ctl status` just before the
    stop (None if it did not answer), returncode}."""
    command = [sys.executable, "-m", "grpod", "start", "--config", str(config)]
    for override in overrides:
        command += ["--set", override]
    launched = time.time()
    with open(log, "w") as out:
        daemon = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            daemon.wait(timeout=minutes * 60)
            raise RuntimeError(f"grpod exited early ({daemon.returncode}); see {log}")
        except subprocess.TimeoutExpired:
            pass
        stopped = time.time()
        status = ctl(run_dir / "grpod.sock", "status")
        ctl(run_dir / "grpod.sock", "stop")
        daemon.wait(timeout=600)
    return {"launched": launched, "stopped": stopped, "status": status.get("result"),
            "returncode": daemon.returncode}
