"""bench/signal_bound.py recovers the pass rates behind a run's draws from what the run recorded
(trained groups in rollouts.jsonl, thrown-away groups counted in `dynamic_filtered`) and prices
sampling schemes on them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import signal_bound as bound


def write_run(run: Path, groups: list[int], size: int, filtered: int) -> None:
    """A run directory whose trained groups had `groups[i]` passing completions of `size`."""
    run.mkdir()
    lines = [json.dumps({"step": 1, "group": {"scores": [1.0] * j + [0.0] * (size - j)}}) for j in groups]
    (run / "rollouts.jsonl").write_text("\n".join(lines) + "\n")
    steps = [{"kind": "step", "step": 1, "dynamic_filtered": 0, "gradient_token_share": 0.5},
             {"kind": "sync", "version": 1},
             {"kind": "step", "step": 2, "dynamic_filtered": filtered, "gradient_token_share": 0.25}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(s) for s in steps) + "\n")


def test_half_the_draws_never_solved_half_at_even_odds(tmp_path):
    size, draws = 8, 25600
    # Half the draws from rows never solved (filtered), half at p = 0.5: their groups in the
    # binomial proportions, the two all-alike outcomes of those filtered too.
    groups = [j for j in range(1, size) for _ in range(round(draws / 2 * math.comb(size, j) / 2**size))]
    filtered = draws // 2 + round(draws / 2 * 2 / 2**size)
    write_run(tmp_path / "run", groups, size, filtered)
    result = bound.analyse(tmp_path / "run", threshold=1.0)
    assert result["groups_filtered"] == filtered
    assert result["gradient_token_share"] == 0.25  # the last step record's
    assert result["observed_mixed_share"] == pytest.approx(len(groups) / (len(groups) + filtered))
    assert result["fit_signal"] == pytest.approx(0.5 * (1 - 2 / 2**size), abs=0.005)
    assert result["extreme_draws"] == pytest.approx(0.5, abs=0.02)
    assert result["in_band_draws"] == pytest.approx(0.5, abs=0.02)
    # Screening 2: a quarter of the draws go on (mixed at 2), the rest cost 2 completions each.
    assert result["screen"]["2"] == pytest.approx(0.25 * 8 / (0.25 * 8 + 0.75 * 2), abs=0.01)


def test_a_group_scored_alike_in_pass_or_fail_counts_as_alike(tmp_path):
    # Trained groups with 0 or 4 passing (their signal was partial credit) are alike, as filtered ones.
    write_run(tmp_path / "run", [0, 4, 2, 2], 4, filtered=0)
    size, counts, last = bound.outcomes(tmp_path / "run", threshold=1.0)
    assert (size, counts, last["dynamic_filtered"]) == (4, {0: 1, 4: 1, 2: 2}, 0)
    assert bound.analyse(tmp_path / "run", 1.0)["observed_mixed_share"] == 0.5


def test_a_run_without_recorded_rollouts_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "step", "step": 1}) + "\n")
    with pytest.raises(SystemExit, match="record_rollouts"):
        bound.analyse(run, 1.0)
