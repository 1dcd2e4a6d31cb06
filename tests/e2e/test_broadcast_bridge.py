"""Bridge mode `broadcast` end to end (issue #15): one trainer, two local vLLM engines, the weights
sent to both at once through vLLM's weight-transfer API (gloo on CPU).

A real `grpod start` with `inference.engines = 2` trains ≥ 5 steps: every sync reaches both
engines in one group and probes each at the same version, the builtin source's groups come from
both engines (least-outstanding dispatch), and the run ends with no process of either engine left.
"""

from __future__ import annotations

import json

import pytest

from grpod.service.logs import read_metrics
from tests.harness import DaemonProcess, base_settings, group_processes, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

STEPS = 6


def test_one_trainer_two_engines_broadcast_every_sync_to_both(tmp_path, warm_model_dir):
    run_dir = tmp_path / "run"
    settings = base_settings(run_dir, warm_model_dir) | {
        "train.steps": STEPS,
        "bridge.mode": "broadcast",
        "bridge.sync_every": 2,
        "inference.engines": 2,
        "inference.start_timeout_s": 400.0,
        "source.concurrency": 4,
        "run.record_rollouts": True,
    }
    daemon = DaemonProcess(write_config(tmp_path / "grpod.toml", settings), run_dir)
    try:
        assert daemon.wait_exit(800) == 0, daemon.tail()
    finally:
        daemon.close()
    assert len(daemon.vllm_pgids) == 2, "one process group per engine"
    for pgid in daemon.vllm_pgids:
        assert group_processes(pgid) == [], f"engine process group {pgid} left behind"

    records = read_metrics(run_dir)
    steps = [r for r in records if r["kind"] == "step" and not r.get("skipped")]
    syncs = [r for r in records if r["kind"] == "sync"]
    assert len(steps) >= 5
    assert [s["version"] for s in syncs] == [1, 2, 3] and all(s["probe"]["ok"] for s in syncs), syncs
    assert all("broadcast" in s["phases"] for s in syncs)
    events = [json.loads(line) for line in (run_dir / "grpod.log").read_text().splitlines() if line.strip()]
    probed = {}
    for e in events:
        if e.get("event") == "engine_probed":
            probed.setdefault(e["version"], set()).add(e["engine"])
    for version in (0, 1, 2, 3):
        assert probed.get(version) == {"engine-0", "engine-1"}, f"version {version}: probed {probed.get(version)}"
    epochs = [e for e in events if e.get("event") == "weight_group_epoch"]
    assert len(epochs) == 1 and epochs[0]["engines"] == ["engine-0", "engine-1"], "one group, formed once"
    groups = [json.loads(line)["group"] for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    by_engine = {g["extra"]["engine"] for g in groups}
    assert by_engine == {"engine-0", "engine-1"}, f"groups came from {by_engine}"
