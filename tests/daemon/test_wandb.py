"""W&B mirroring of the metrics, with the real wandb package in offline mode (no network)."""

from __future__ import annotations

from grpod.service.logs import MetricsLog, WandbSink, read_metrics


def _run_files(run_dir):
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_step_and_eval_numbers_reach_an_offline_wandb_run_named_after_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    metrics = MetricsLog(run_dir / "metrics.jsonl", WandbSink("grpod-test", None, "offline", run_dir, {"train": {"lr": 1e-4}}))
    metrics.write("step", 1, {"loss_total": 0.125, "reward_mean": 0.375, "group_ids": ["g-1"], "skipped": False})
    metrics.write("eval", 1, {"accuracy_marker": 0.8125})
    metrics.close()

    files = _run_files(run_dir)
    assert len(files) == 1 and files[0].name.startswith("run-grpod-")
    data = files[0].read_bytes()
    for expected in (b"step/loss_total", b"step/reward_mean", b"eval/accuracy_marker", b"0.8125", b"grpod-test", b"my-run"):
        assert expected in data, expected
    assert b"step/group_ids" not in data and b"step/skipped" not in data, "only numbers are mirrored"
    # metrics.jsonl is still the record of everything
    assert [r["kind"] for r in read_metrics(run_dir)] == ["step", "eval"]


def test_a_resumed_daemon_logs_to_the_same_run_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ids = []
    for _ in range(2):
        sink = WandbSink("grpod-test", None, "offline", run_dir, {})
        ids.append(sink.run.id)
        sink.close()
    assert ids[0] == ids[1] and ids[0].startswith("grpod-")
