"""bench/memory_soak.py's arithmetic: the slope it reports and the readings it keeps after warm-up."""

from bench.memory_soak import slope_per_100_steps, summarise


def reading(step, daemon_mib, engine_mib):
    return {"kind": "memory", "step": step, "time": 0.0, "daemon_rss_mib": daemon_mib, "children_rss_mib": 10.0,
            "engine_rss_mib/engine-0": engine_mib, "engine_gpu_mib/engine-0": 700.0}


def test_a_steady_growth_is_its_slope_and_warmup_is_left_out():
    # the daemon grows 2 MiB a step during warm-up, then 0.05 MiB a step; the engine is flat
    readings = [reading(s, 500 + 2 * min(s, 50) + 0.05 * max(s - 50, 0), 900) for s in range(0, 400, 10)]
    summary = summarise(readings, warmup=50)
    assert summary["steps"] == [50, 390] and summary["readings_after_warmup"] == 35
    assert set(summary["figures"]) == {"daemon", "children", "engine-0", "engine-0 GPU"}
    assert summary["figures"]["daemon"]["slope_mib_per_100_steps"] == 5.0
    assert summary["figures"]["engine-0"]["slope_mib_per_100_steps"] == 0.0
    assert summary["figures"]["children"]["first_mib"] == 10.0


def test_too_few_readings_have_no_slope():
    assert slope_per_100_steps([(1, 1.0), (2, 2.0)]) is None
    assert slope_per_100_steps([(5, 1.0)] * 4) is None
