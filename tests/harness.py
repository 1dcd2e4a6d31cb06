"""Test harness for running a real `grpod start` as a child process and talking to it.

The tests signal only what they start, by PID; `DaemonProcess.close` SIGKILLs a daemon that is
still alive at the end of a test and then stops the vLLM process group it had launched, found
through the daemon's `ctl status` (vLLM's pid) recorded while it ran.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from grpod.config_docs import toml_value
from grpod.daemon.control import ControlError, request
from grpod.service.logs import read_metrics
from grpod.inference.release import group_members

ROOT = Path(__file__).resolve().parents[1]


def write_config(path: Path, settings: dict[str, Any]) -> Path:
    """Write a TOML config from {"section.key": value} (nested sections with dots)."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        section, _, name = key.rpartition(".")
        sections.setdefault(section, {})[name] = value
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in values.items())
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def base_settings(run_dir: Path, model_dir: Path) -> dict[str, Any]:
    return {
        "run.dir": str(run_dir),
        "run.progress": True,
        "model.path": str(model_dir),
        "model.init_if_missing": False,
        "source.group_size": 4,
        "source.max_tokens": 6,
        "source.prefetch_groups": 4,
        "source.concurrency": 2,
        "train.steps": 4,
        "train.groups_per_step": 2,
        "train.lr": 3e-4,
        "train.threads": 1,
        "train.advantages.drop_zero_variance": False,
        "checkpoint.every": 0,
        "eval.size": 0,
        "inference.start_timeout_s": 240.0,
    }


def group_processes(pgid: int) -> list[psutil.Process]:
    """Live members of process group `pgid` (`group_members`: a zombie whose threads are all gone
    holds nothing and is not counted)."""
    return group_members(pgid)


def torchrun(nproc: int, *, max_restarts: int = 0) -> list[str]:
    """What starts `-m grpod ...` as `nproc` trainer ranks on this machine: torchrun, its
    rendezvous on a free port (--standalone), restarting the whole group up to `max_restarts` times."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}"]


class DaemonProcess:
    def __init__(
        self, config: Path, run_dir: Path, extra_args: list[str] | None = None, env: dict | None = None,
        prefix: list[str] | None = None, launcher: list[str] | None = None, piped: bool = False,
    ):
        """`grpod start`; with `launcher` (e.g. `torchrun(2)`) that launcher starting it, in a
        session of its own so that `close` stops the launcher and every rank by group; with
        `prefix`, a command that execs what follows in place (e.g. `ip netns exec NAME`); `piped`:
        its stdout and stderr are pipes the test holds (`proc.stdout`, `proc.stderr`)."""
        self.config = config
        self.run_dir = run_dir
        self.socket = run_dir / "grpod.sock"
        self._status_pgids: set[int] = set()
        self.output = run_dir.parent / f"{run_dir.name}-daemon.out"
        self._out = open(self.output, "ab")
        self.launched = launcher is not None
        self.proc = subprocess.Popen(
            [*(prefix or []), *(launcher or [sys.executable]), "-m", "grpod", "start", "--config", str(config), *(extra_args or [])],
            cwd=ROOT,
            stdout=subprocess.PIPE if piped else self._out,  # piped: the test reads (or drops) them
            stderr=subprocess.PIPE if piped else subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=self.launched,
        )

    def rank_processes(self) -> dict[int, psutil.Process]:
        """The launcher's trainer ranks alive now, by their RANK."""
        ranks = {}
        for child in psutil.Process(self.proc.pid).children():
            try:
                ranks[int(child.environ()["RANK"])] = child
            except (psutil.NoSuchProcess, KeyError, ValueError):
                continue
        return ranks

    def ctl(self, cmd: str, timeout_s: float = 300.0) -> dict[str, Any]:
        reply = request(self.socket, cmd, timeout_s=timeout_s)
        if cmd == "status" and reply.get("ok"):
            pid = ((reply["result"].get("bridge") or {}).get("vllm") or {}).get("pid")
            if pid:
                self._status_pgids.add(pid)  # vLLM leads its own process group: pgid == pid
        return reply

    @property
    def vllm_pgids(self) -> set[int]:
        """Every vLLM process group this daemon launched (its log's launch events, and status)."""
        found = set(self._status_pgids)
        log = self.run_dir / "grpod.log"
        if log.exists():
            for line in log.read_text(errors="replace").splitlines():
                if '"inference_launched"' in line:
                    try:
                        found.add(int(json.loads(line)["pid"]))
                    except (ValueError, KeyError):
                        continue
        return found

    def wait_for(self, predicate, timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited ({self.proc.returncode}) while waiting for {what}:\n{self.tail()}")
            try:
                reply = self.ctl("status", timeout_s=10)
            except ControlError:
                time.sleep(0.5)
                continue
            last = reply["result"]
            if predicate(last):
                return last
            time.sleep(0.3)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last status {last}\n{self.tail()}")

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"daemon still running after {timeout_s}s\n{self.tail()}") from None

    def tail(self, n: int = 60) -> str:
        if not self._out.closed:
            self._out.flush()
        return "\n".join(self.output.read_text(errors="replace").splitlines()[-n:])

    def close(self, *, stop_vllm: bool = True) -> None:
        """Kill the daemon if still alive (a launcher: with its ranks, by process group); then
        (unless told not to) any vLLM group it left."""
        if self.launched and group_processes(self.proc.pid):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        if not self._out.closed:
            self._out.close()
        if stop_vllm:
            self.stop_vllm_groups()

    def stop_vllm_groups(self) -> None:
        for pgid in self.vllm_pgids:
            if group_processes(pgid):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    """A daemon's metrics.jsonl records so far (none before its first write)."""
    return read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []


def start_decoy(tmp_path: Path) -> subprocess.Popen:
    """A process whose command line says "vllm" and "grpod" that grpod must never touch."""
    script = tmp_path / "vllm_grpod_decoy.py"
    script.write_text("import time\ntime.sleep(3600)\n")
    return subprocess.Popen(
        [sys.executable, str(script), "--model", "vllm.entrypoints.openai.api_server", "grpod"],
        start_new_session=True,
    )
