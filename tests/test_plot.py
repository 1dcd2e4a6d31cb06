import json

import pytest

from grpod.plot import PlotError, plot_run


def test_plot_writes_a_png_with_every_panel(tmp_path):
    lines = []
    for step in range(1, 6):
        lines.append({"kind": "step", "step": step, "reward_mean": step / 10, "loss": 0.1, "kl": 0.01,
                      "ratio_mean": 1.0, "ratio_min": 0.9, "ratio_max": 1.1, "staleness_mean": 0.5,
                      "staleness_max": 1, "sync_s": 0.01})
        lines.append({"kind": "sync", "step": step, "total_s": 0.05, "weights_step": step})
    lines.append({"kind": "eval", "step": 0, "eval_accuracy": 0.2})
    lines.append({"kind": "eval", "step": 5, "eval_accuracy": 0.4})
    lines.append({"kind": "memory", "step": 5, "daemon_rss_mib": 500.0, "engine_rss_mib/engine-0": 1200.0})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    out = plot_run(tmp_path)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_errors_name_the_problem(tmp_path):
    with pytest.raises(PlotError, match="no metrics"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"kind": "step"}\nnot json\n')
    with pytest.raises(PlotError, match=":2: not a JSON line"):
        plot_run(tmp_path)


def test_the_algorithm_metrics_have_panels_and_status_rows():
    from grpod.daemon.status import render_table, status_table
    from grpod.plot import PANELS

    plotted = {key for _, _, keys in PANELS for key in keys}
    assert {"entropy", "clipped_low_fraction", "clipped_high_fraction", "mismatch_kl", "tis_masked_fraction"} <= plotted
    table = render_table(status_table({"last_metrics": {"entropy": 1.25, "clipped_fraction": 0.1, "mismatch_kl": 0.002}}))
    assert "entropy" in table and "1.25" in table and "clipped_fraction" in table and "mismatch_kl" in table


def test_dataset_runs_plot_mean_at_k_and_each_reward_function():
    from grpod.plot import PANELS, panel_series

    records = [
        {"kind": "step", "step": 1, "reward_mean": 0.5, "reward/correct": 0.25, "reward/format": 1.0},
        {"kind": "step", "step": 2, "reward_mean": 0.7, "reward/correct": 0.5, "reward/format": 1.0},
        {"kind": "eval", "step": 2, "eval_accuracy": 0.4, "eval_mean_at_k": 0.3},
    ]
    panels = {title: (kind, keys) for title, kind, keys in PANELS}
    reward = panel_series(records, *panels["reward"])
    assert reward == {"reward_mean": [(1, 0.5), (2, 0.7)], "reward/correct": [(1, 0.25), (2, 0.5)],
                      "reward/format": [(1, 1.0), (2, 1.0)]}
    held_out = panel_series(records, *panels["held-out accuracy"])
    assert held_out == {"eval_accuracy": [(2, 0.4)], "eval_mean_at_k": [(2, 0.3)]}


def test_status_shows_the_sources_drops_and_each_reward_function():
    from grpod.daemon.status import render_table, status_table

    table = render_table(status_table({
        "source": {"kind": "dataset", "generated": 40, "dropped": 3, "drop_reasons": {"reward_error": 2, "reward_timeout": 1}},
        "last_metrics": {"reward_mean": 0.5, "reward/correct": 0.25},
    }))
    assert "dataset: 40 generated, 3 dropped {'reward_error': 2, 'reward_timeout': 1}" in table
    assert "reward/correct" in table and "0.25" in table


def test_memory_readings_are_a_panel_each_engine_a_line():
    from grpod.inference.memory import MemoryReading
    from grpod.plot import PANELS, panel_series

    reading = MemoryReading(0.0, 500 << 20, 30 << 20, {"engine-0": {"rss": 1200 << 20, "gpu": None},
                                                       "engine-1": {"rss": 1100 << 20, "gpu": 700 << 20}})
    records = [{"kind": "memory", "step": 4, **reading.record()}]
    memory = panel_series(records, *{title: (kind, keys) for title, kind, keys in PANELS}["resident memory (MiB)"])
    assert memory == {"daemon_rss_mib": [(4, 500.0)], "children_rss_mib": [(4, 30.0)],
                      "engine_rss_mib/engine-0": [(4, 1200.0)], "engine_rss_mib/engine-1": [(4, 1100.0)],
                      "engine_gpu_mib/engine-1": [(4, 700.0)]}
