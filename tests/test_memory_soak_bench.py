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


def test_speed_counts_the_steps_and_tokens_after_warmup_and_a_variant_is_its_sets():
    from bench.memory_soak import parse_variant, speed

    steps = [{"step": s, "time": 100.0 + 0.5 * s, "completion_tokens": 40.0 if s >= 10 else 999.0} for s in range(1, 31)]
    # steps 10..30 after warm-up 10: 20 steps in 10 s, each 40 tokens (the first one's are before the span)
    assert speed(steps, warmup=10) == {"steps_per_s": 2.0, "generated_tokens_per_s": 80.0}
    assert speed(steps[:1], warmup=0) == {"steps_per_s": None, "generated_tokens_per_s": None}
    assert parse_variant('cap0:inference.env={A="0"};train.lr=1e-5') == ("cap0", ['inference.env={A="0"}', "train.lr=1e-5"])
    assert parse_variant("default:") == ("default", [])


def test_readings_after_the_last_step_are_left_out_and_a_saved_file_reads_the_same(capsys):
    """A reading taken while the run stops finds its engine half stopped (618 of 1758 MiB): only
    the readings up to the last step count, also when the table is printed from a saved file."""
    from bench.memory_soak import print_table

    readings = [reading(s, 500, 900 + s) for s in range(0, 110, 10)] + [dict(reading(100, 500, 300), time=9.0)]
    for i, r in enumerate(readings[:-1]):
        r["time"] = float(i) / 10
    summary = summarise(readings, warmup=0, until=1.0)
    assert summary["figures"]["engine-0"]["last_mib"] == 1000 and summary["readings_after_warmup"] == 11
    assert summarise(readings, warmup=0)["figures"]["engine-0"]["last_mib"] == 300, "without the bound: the stop's reading"
    saved = {"steps": 100, "warmup_steps": 0, "runs": [
        {"mode": "none", "trained_steps": 100, "series": readings},  # an older file: no variant, no step times
        {"mode": "none", "variant": "cap0", "turn": 1, "trained_steps": 100, "steps_per_s": 5.0,
         "generated_tokens_per_s": 700.0, "series": readings, "step_times": [[100, 1.0]]},
    ]}
    print_table(saved)
    rows = [line for line in capsys.readouterr().out.splitlines() if "| engine-0 |" in line]
    # The older file has no step times: every reading at the last step is left out with the stop's.
    assert len(rows) == 2 and "900 → 990 |" in rows[0] and "900 → 1000 |" in rows[1], rows
