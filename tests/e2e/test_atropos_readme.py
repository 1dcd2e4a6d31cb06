"""docs/atropos.md ("Train with an Atropos environment"), followed as a newcomer would, with real processes:
atroposlib's `run-api`, `grpod start` on the example config (SmolLM2-135M-Instruct on a real vLLM),
then the example environment `etc/examples/atropos/arith_env.py serve`, which samples from grpod's
vLLM (`POST /generate`) and posts scored groups to run-api, from which grpod trains.

The example config is copied into the test's directory with only what must differ on a shared
machine changed (run.dir, a free inference.port, the run-api URL, the model directory), so no
tracked file is written; `--set train.steps=5` keeps the run short. Every process the test starts
is stopped by its PID. A second copy of the environment runs beside the first on the other route
the page documents, `--env.route chat` (`/v1/chat/completions`, answers tokenized by
atroposlib's `tokenize_for_trainer` through the transformers 5 shim): one grpod run trains on the
groups of both (one vLLM start instead of two), and `rollouts.jsonl` tells them apart.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.atropos_env import TrajectoryApiProcess, free_port
from tests.harness import ROOT, DaemonProcess, group_processes, metrics, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

EXAMPLE_DIR = ROOT / "etc" / "examples" / "atropos"
STEPS = 5
VLLM_START_S = 300.0
TRAIN_S = 600.0


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def copy_example_config(tmp_path: Path, **changes: Any) -> Path:
    settings = flatten(tomllib.loads((EXAMPLE_DIR / "grpod-atropos.toml").read_text()))
    assert set(changes) <= set(settings), "only keys the example sets are changed"
    return write_config(tmp_path / "grpod-atropos.toml", settings | changes)


def wait_for_line(daemon: DaemonProcess, pattern: str, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, daemon.output.read_text(errors="replace"))
        if found:
            return found
        if daemon.proc.poll() is not None:
            raise AssertionError(f"grpod exited ({daemon.proc.returncode}) before printing {pattern!r}:\n{daemon.tail()}")
        time.sleep(0.5)
    raise AssertionError(f"grpod printed no {pattern!r} within {timeout_s}s:\n{daemon.tail()}")


class EnvironmentProcess:
    """`python etc/examples/atropos/arith_env.py serve ...`, stopped by its PID."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE_DIR / "arith_env.py"), "serve", *args],
            cwd=ROOT,
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    def tail(self, n: int = 40) -> str:
        self._out.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._out.close()


def run_readme_path(tmp_path: Path, model_dir: Path, *, steps: int, routes: list[str]) -> dict[str, Any]:
    """run-api, then grpod on the example config, then the example environment (one per route), as
    docs/atropos.md says; returns once grpod has exited 0 after `steps` steps, with what it recorded."""
    started = time.monotonic()
    run_dir = tmp_path / "run"
    port = free_port()
    with TrajectoryApiProcess(tmp_path) as api:
        config = copy_example_config(
            tmp_path,
            **{
                "run.dir": str(run_dir),
                "inference.port": port,
                "source.atropos_url": api.url,
                "model.path": str(model_dir),
            },
        )
        daemon = DaemonProcess(
            config, run_dir, extra_args=["--set", f"train.steps={steps}", "--set", "run.record_rollouts=true"]
        )
        envs: list[EnvironmentProcess] = []
        try:
            announced = wait_for_line(daemon, r"vLLM serves the policy at (\S+) \(model names: ([^)]*)\)", VLLM_START_S)
            base_url, names = announced.group(1), announced.group(2).split(", ")
            assert base_url == f"http://127.0.0.1:{port}/v1"
            assert names[0] == "policy" and str(model_dir) in names

            status = subprocess.run(
                [sys.executable, "-m", "grpod", "ctl", "status", "--config", str(config)],
                cwd=ROOT, capture_output=True, text=True, timeout=60,
            )
            assert status.returncode == 0, status.stderr
            assert re.search(rf"vLLM URL\s+{re.escape(base_url)} \(models: policy, ", status.stdout), status.stdout

            for route in routes:
                envs.append(EnvironmentProcess(
                    [
                        "--openai.base_url", base_url,
                        "--openai.model_name", str(model_dir),
                        "--env.tokenizer_name", str(model_dir),
                        "--env.rollout_server_url", api.url,
                        "--env.route", route,
                    ],
                    tmp_path / f"arith_env-{route}.out",
                ))  # fmt: skip
            said = lambda: "\n".join(f"--- environment ({e.log.name}):\n{e.tail()}" for e in envs)  # noqa: E731
            try:
                code = daemon.wait_exit(TRAIN_S)
            except AssertionError:
                raise AssertionError(f"grpod did not finish; the environments said:\n{said()}") from None
            assert code == 0, f"{daemon.tail()}\n{said()}"
        finally:
            for env in envs:
                env.stop()
            daemon.close()
    for pgid in daemon.vllm_pgids:
        assert group_processes(pgid) == [], f"vLLM process group {pgid} left behind"
    steps_recorded = [r for r in metrics(run_dir) if r["kind"] == "step"]
    events = [json.loads(line) for line in (run_dir / "grpod.log").read_text().splitlines() if line.strip()]
    env_logs = "".join((tmp_path / f"arith_env-{route}.out").read_text(errors="replace") for route in routes)
    groups = [json.loads(line)["group"] for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    return {
        "trained": [r for r in steps_recorded if not r.get("skipped")],
        "skipped": [r for r in steps_recorded if r.get("skipped")],
        "batches": [e for e in events if e.get("event") == "atropos_batch_received"],
        "groups": groups,
        "groups_not_sent": env_logs.count("Scores are the same in a group, skipping"),
        "wall_s": time.monotonic() - started,
    }


def report(name: str, run: dict[str, Any]) -> None:
    print(
        f"\n{name}: {len(run['trained'])} steps trained, {len(run['batches'])} batches, "
        f"{run['groups_not_sent']} groups not sent (all answers scored alike), wall {run['wall_s']:.0f} s"
    )


def test_the_readme_atropos_path_trains_on_the_example_environment_on_both_routes(tmp_path, smollm2_dir):
    run = run_readme_path(tmp_path, smollm2_dir, steps=STEPS, routes=["generate", "chat"])
    report("README Atropos path (routes generate and chat)", run)
    assert len(run["trained"]) >= STEPS and run["skipped"] == []
    assert len(run["batches"]) >= STEPS and all(b["accepted"] == b["groups"] == 2 for b in run["batches"])
    # Route generate: /generate answers carry vLLM's logprobs, which the groups bring along.
    with_logprobs = [g for g in run["groups"] if g.get("inference_logprobs") is not None]
    # Route chat: /v1/chat/completions, answers tokenized by `tokenize_for_trainer` through the
    # shim (without it nothing would arrive); no logprobs, so those tokens train with IS weight 1.
    without = [g for g in run["groups"] if g.get("inference_logprobs") is None]
    assert with_logprobs and without, (len(with_logprobs), len(without))
    assert sum(r["is_uncorrected_tokens"] for r in run["trained"]) > 0
