"""The peer bench (bench/peers/): the grpod config restated for TRL (`workload.py`), and the
figures `compare.py` reads from grpod's own run records. TRL itself (the optional `bench` extra)
is not needed for either."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpod.service import logs
from grpod.service.logs import MetricsLog
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.replay import record_groups

ROOT = Path(__file__).resolve().parents[1]


def bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"peers_{name}", ROOT / "bench" / "peers" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


workload = bench_module("workload")
compare = bench_module("compare")


def test_trl_gets_the_configs_batch_group_size_steps_and_lr_and_a_knob_it_lacks_is_refused():
    cfg = workload.load(ROOT / "etc" / "grpod.toml", ["train.lr=3e-4", "train.steps=40"])
    kwargs = workload.grpo_config_kwargs(cfg, completion_tokens=8)
    batch = cfg.train.groups_per_step * cfg.source.group_size
    assert kwargs["per_device_train_batch_size"] == kwargs["generation_batch_size"] == batch
    assert kwargs["num_generations"] == cfg.source.group_size and kwargs["gradient_accumulation_steps"] == 1
    assert (kwargs["learning_rate"], kwargs["max_steps"], kwargs["seed"]) == (3e-4, 40, cfg.run.seed)
    assert kwargs["max_completion_length"] == 8 and kwargs["use_vllm"] is False
    odd = workload.load(ROOT / "etc" / "grpod.toml", ["train.advantages.estimator=rloo", "train.advantages.std=population"])
    with pytest.raises(workload.WorkloadError, match=r"estimator = 'rloo'.*std = 'population'"):
        workload.grpo_config_kwargs(odd, completion_tokens=8)


def test_trl_sees_grpods_prompt_tokens_held_out_rows_and_reward_on_the_smollm2_example(smollm2_dir, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository root
    example = ROOT / "etc" / "examples" / "smollm2-dataset.toml"
    cfg = workload.load(example, [f"model.path={smollm2_dir}", "source.dataset.epochs=1"])
    work = workload.Workload(cfg, AutoTokenizer.from_pretrained(smollm2_dir))
    train = work.train_examples(6)
    work.check_prompt_tokens(train)  # TRL's chat rendering of each prompt is grpod's token ids
    held_out = work.eval_examples()
    assert len(held_out) == cfg.eval.size
    rows = [json.loads(line) for line in Path(cfg.eval.dataset).read_text().splitlines()]
    assert [e.columns["answer"] for e in held_out] == [r["answer"] for r in rows[: cfg.eval.size]]
    first, second = held_out[0].columns, held_out[1].columns
    texts = [f"That makes {first['answer']}.", f"That makes {int(second['answer']) + 1}."]
    scores = work.scores([first, second], texts, [[1], [1]])
    assert scores == [1.0, 0.0] and work.correct(scores[0]) and not work.correct(scores[1])
    train_rows = len(Path(cfg.source.dataset.path).read_text().splitlines())
    with pytest.raises(workload.WorkloadError, match=f"gives {train_rows} prompts, fewer than {train_rows + 1}"):
        work.train_examples(train_rows + 1)


def test_compare_reads_rates_thresholds_and_trls_final_accuracy_from_grpods_records(tmp_path, monkeypatch):
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(logs, "time", SimpleNamespace(time=lambda: clock.now))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    # Launch at 100 s; evaluations at 110 (step 0), 130 (step 2) and 150 (step 4); steps every 5 s.
    for now, kind, step, values in [
        (110.0, "eval", 0, {"eval_accuracy": 0.1, "when": "start"}),
        (120.0, "step", 1, {"sampled_tokens": 100}),
        (125.0, "step", 2, {"sampled_tokens": 220}),
        (130.0, "eval", 2, {"eval_accuracy": 0.55, "when": "periodic"}),
        (130.0, "step", 3, {"sampled_tokens": 340}),
        (135.0, "step", 4, {"sampled_tokens": 460, "dynamic_filtered": 3}),
        (150.0, "eval", 4, {"eval_accuracy": 0.85, "when": "end"}),
    ]:
        clock.now = now
        metrics.write(kind, step, values)
    metrics.close()
    for step in range(1, 5):
        group = RolloutGroup(tokens=[[1, 2, 3]] * 2, loss_mask=[[0, 1, 1], [0, 1, 0]], scores=[1.0, 0.0])
        record_groups(run_dir / "rollouts.jsonl", step, [group])  # 3 trained tokens a step

    grpod = compare.Run(side="grpod", seed=0, run_dir=run_dir, launch=100.0)
    compare._read_grpod(grpod)
    assert grpod.first_step_s() == 20.0 and grpod.threshold_s(0.5) == 30.0 and grpod.threshold_s(0.9) is None
    assert grpod.steps_per_s() == pytest.approx(3 / 15)
    assert grpod.tokens_per_s() == pytest.approx(9 / 15), "trained tokens after the first step, over its span"
    assert grpod.sampled_tokens_per_s() == pytest.approx(360 / 15)
    assert grpod.accuracy_at_time(45.0) == 0.55 and grpod.accuracy_at_step(4) == 0.85

    trl = compare.Run(side="trl", seed=0, run_dir=tmp_path, launch=0.0)
    trl.evals = [{"step": 0, "time": 30.0, "accuracy": 0.1}, {"step": 5, "time": 120.0, "accuracy": 0.55}]
    trl.steps = [{"step": 1, "time": 60.0, "tokens": 4}, {"step": 5, "time": 100.0, "tokens": 4}]
    text, summary = compare.table([grpod, trl], ["grpod", "trl"], [0.5])
    assert summary["rows"]["launch -> trl's final held-out accuracy 0.550 (s)"] == {"grpod": "30.0", "trl": "120.0"}
    assert summary["rows"]["launch -> held-out accuracy >= 0.5 (s)"] == {"grpod": "30.0", "trl": "120.0"}
    assert "| held-out accuracy at step 5 | - | 0.550 |" in text
    assert summary["rows"]["groups generated and thrown away by dynamic sampling (launch to last step)"] == {
        "grpod": "3", "trl": "-"}


def test_trl_gets_a_conversational_datasets_own_reward_functions(monkeypatch):
    """The TRL-style example's module goes to TRL's GRPOTrainer as it is (weights and aggregation
    mapped), not through a wrapper: the same module trains on both sides of the bench."""
    from grpod.models.tiny import build_tokenizer

    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository root
    cfg = workload.load(ROOT / "etc" / "examples" / "trl-rewards.toml", [])
    work = workload.Workload(cfg, build_tokenizer())
    functions, weights = work.trl_reward_functions()
    assert [f.__name__ for f in functions] == ["correct", "reward_len", "digits_only", "carry_bonus"]
    assert weights == [1.0, 0.5, 0.5, 0.5]
    assert workload.AGGREGATIONS[cfg.source.dataset.reward_aggregation] == "sum_then_normalize"
    row = work.train_examples(1)[0]
    completions = [[{"role": "assistant", "content": row.columns["answer"]}]]
    assert functions[0](prompts=[row.messages], completions=completions, answer=[row.columns["answer"]]) == [1.0]


def test_timed_runs_report_each_sides_saved_weights_at_each_mark_with_a_wilson_interval(tmp_path):
    """--minutes: the one evaluator's score of each side's weights at each mark, pooled over seeds
    with its 95 % Wilson interval; a mark a side never reached is '-'."""
    grpod = compare.Run(side="grpod", seed=0, run_dir=tmp_path, launch=0.0)
    grpod.saved = [{"minutes": 5.0, "step": 40, "correct": 30, "size": 200, "accuracy": 0.15},
                   {"minutes": 10.0, "step": 80, "correct": 60, "size": 200, "accuracy": 0.3}]
    trl = compare.Run(side="trl", seed=0, run_dir=tmp_path, launch=0.0, threads=2)
    trl.saved = [{"minutes": 5.0, "step": 6, "correct": 20, "size": 200, "accuracy": 0.1}]
    start = {"correct": 10, "size": 200, "accuracy": 0.05}
    _, summary = compare.table([grpod, trl], ["grpod", "trl"], [0.5], [5.0, 10.0], start)
    rows = summary["rows"]
    low, high = compare.wilson(30, 200)
    assert rows["held-out accuracy at 5 min after launch (one evaluator, 95 % Wilson)"] == {
        "grpod": f"0.150 [{low:.3f}, {high:.3f}]", "trl": "0.100 [0.066, 0.149]"}
    assert rows["held-out accuracy at 10 min after launch (one evaluator, 95 % Wilson)"]["trl"] == "-"
    assert rows["steps trained by 5 min"] == {"grpod": "40", "trl": "6"}
    assert rows["TRL torch threads"] == {"grpod": "-", "trl": "2"}
    assert rows["held-out accuracy of the starting model (one evaluator)"]["grpod"].startswith("0.050 [")
    # No in-run evaluation, so no time to a threshold (it would read "not reached" at any score).
    assert not any(name.startswith("launch -> held-out accuracy >=") for name in rows)


def test_timed_runs_compare_the_sides_row_by_row_on_the_seeds_both_scored(tmp_path):
    """The evaluator's per-row outcomes pair the sides: the difference's interval is computed on the
    rows (each row's difference averaged over the seeds, since every seed scores the same rows), so
    rows both sides get right or wrong narrow it; a seed only one side scored is left out."""
    n = 100
    trl_rows = [1] * 20 + [0] * 80
    grpod_rows = [1] * 30 + [0] * 70  # right on TRL's 20 and on 10 more
    grpod = [compare.Run(side="grpod", seed=seed, run_dir=tmp_path, launch=0.0) for seed in (0, 1)]
    trl = [compare.Run(side="trl", seed=0, run_dir=tmp_path, launch=0.0, threads=2)]
    for run, rows in ((grpod[0], grpod_rows), (grpod[1], [0] * n), (trl[0], trl_rows)):
        run.saved = [{"minutes": 5.0, "step": 1, "correct": sum(rows), "size": n, "accuracy": sum(rows) / n, "rows": rows}]
    _, summary = compare.table([*grpod, *trl], ["grpod", "trl"], [], [5.0], None)
    cell = summary["rows"]["grpod minus each side at 5 min, paired on the same rows (95 %)"]
    # 10 rows differ by +1, 90 by 0: mean 0.1, standard error sqrt(0.09 * 100 / 99 / 100) = 0.0302
    assert cell == {"grpod": "-", "trl": "+0.100 [+0.041, +0.159] (1 seeds x 100 rows)"}
    # The unpaired view of the same runs: the two Wilson intervals overlap.
    assert compare.wilson(30, n)[0] < compare.wilson(20, n)[1]
    for run in (*grpod, *trl):
        del run.saved[0]["rows"]
    _, summary = compare.table([*grpod, *trl], ["grpod", "trl"], [], [5.0], None)
    assert summary["rows"]["grpod minus each side at 5 min, paired on the same rows (95 %)"]["trl"] == "-"


def test_the_evaluator_keeps_each_held_out_rows_outcome_in_order(monkeypatch):
    """`held_out_accuracy`: one 0/1 per held-out row, in the rows' order, summing to `correct`;
    the record carries them (the paired comparison reads them)."""
    from grpod.models.tiny import build_model

    monkeypatch.chdir(ROOT)
    cfg = workload.load(ROOT / "etc" / "examples" / "trl-rewards.toml", ["eval.size=6", "eval.max_tokens=4"])
    model, tokenizer = build_model(seed=0)
    work = workload.Workload(cfg, tokenizer)
    held_out = work.eval_examples()
    answers = [e.columns["answer"] for e in held_out]
    # The even rows scored right and the odd ones wrong, whatever the model generated.
    monkeypatch.setattr(work, "scored", lambda columns, texts, ids: (
        [1.0 if c["answer"] in answers[::2] else 0.0 for c in columns], {}))
    scored = workload.held_out_accuracy(model, tokenizer, work, held_out, batch=4)
    expected = [int(a in answers[::2]) for a in answers]
    assert scored.rows == expected and scored.correct == sum(expected) and scored.size == len(held_out) == 6
    assert scored.record()["rows"] == expected


def test_the_paired_difference_averages_seeds_per_row_before_the_interval():
    """Two seeds of the same rows are not 2n independent rows: the interval comes from the n
    per-row differences (each averaged over the seeds). Mismatched rows are refused."""
    paired_difference = compare.paired_difference
    a, b = [1, 1, 0, 0], [0, 1, 0, 0]
    mean, low, high = paired_difference([(a, b), (a, b)])
    assert (mean, low, high) == paired_difference([(a, b)])  # a repeated seed adds no rows
    assert mean == 0.25 and low < 0 < high
    assert paired_difference([([1, 0], [1, 0])]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same rows"):
        paired_difference([([1, 0, 1], [1, 0])])


def test_a_format_reward_beside_a_correctness_reward_gets_its_own_held_out_rows(tmp_path):
    """The format task: the evaluator scores each reward function apart (the rows it gave full
    credit), so a side that learned the tags but not the sums is told from one that learned both;
    one reward function adds no rows (its full credit is the accuracy row already)."""
    grpod = compare.Run(side="grpod", seed=0, run_dir=tmp_path, launch=0.0)
    grpod.saved = [{"minutes": 5.0, "step": 40, "correct": 30, "size": 200, "accuracy": 0.15,
                    "functions": {"reasoning_gym": {"full_credit": 50, "mean": 0.3},
                                  "regex_format": {"full_credit": 180, "mean": 0.9}}}]
    trl = compare.Run(side="trl", seed=0, run_dir=tmp_path, launch=0.0, threads=2)
    trl.saved = [{"minutes": 5.0, "step": 6, "correct": 20, "size": 200, "accuracy": 0.1,
                  "functions": {"reasoning_gym": {"full_credit": 40, "mean": 0.25},
                                "regex_format": {"full_credit": 20, "mean": 0.1}}}]
    start = {"correct": 0, "size": 200, "accuracy": 0.0,
             "functions": {"reasoning_gym": {"full_credit": 8, "mean": 0.1}, "regex_format": {"full_credit": 2, "mean": 0.01}}}
    _, summary = compare.table([grpod, trl], ["grpod", "trl"], [], [5.0], start)
    rows = summary["rows"]
    assert rows["held-out rows given full credit by `regex_format` alone at 5 min (95 % Wilson)"] == {
        "grpod": "0.900 [0.851, 0.934]", "trl": "0.100 [0.066, 0.149]"}
    assert rows["held-out rows given full credit by `reasoning_gym` alone at 5 min (95 % Wilson)"]["grpod"].startswith("0.250 [")
    assert rows["held-out rows given full credit by `regex_format` alone, starting model"]["trl"].startswith("0.010 [")
    for run in (grpod, trl):
        for saved in run.saved:
            saved["functions"] = {"reasoning_gym": saved["functions"]["reasoning_gym"]}
    del start["functions"]
    _, summary = compare.table([grpod, trl], ["grpod", "trl"], [], [5.0], start)
    assert not [name for name in summary["rows"] if "full credit by" in name]


def test_the_evaluator_scores_each_reward_function_apart(monkeypatch):
    """`Workload.scored`: the combined reward (the correctness rule's input) and each function's
    own rewards, by metric name, on the format task's two rewards."""
    from grpod.models.tiny import build_tokenizer

    monkeypatch.chdir(ROOT)
    pattern = r"^\s*<answer>\s*-?\d+\s*</answer>\s*$"
    rewards = f"source.dataset.rewards=[{{function='last_number'}}, {{function='regex_format', pattern='{pattern}', weight=0.5}}]"
    cfg = workload.load(ROOT / "etc" / "examples" / "trl-rewards.toml", [rewards, "eval.correct_threshold=1.5"])
    work = workload.Workload(cfg, build_tokenizer())
    row = work.train_examples(1)[0].columns
    answer = row["answer"]
    texts = [f"<answer>{answer}</answer>", answer, "<answer>x</answer>"]
    combined, by_name = work.scored([row] * 3, texts, [[1]] * 3)
    assert by_name == {"last_number": [1.0, 1.0, 0.0], "regex_format": [1.0, 0.0, 0.0]}
    assert combined == [1.5, 1.0, 0.0]
    assert [work.correct(s) for s in combined] == [True, False, False]  # right but untagged is not correct


def test_trls_gradient_tokens_count_only_completions_whose_advantage_is_not_zero(tmp_path):
    """TRL's side of the gradient token share: a flat group counts nothing, a completion at its
    group's mean counts nothing, a truncated one counts only when truncation is not masked; and the
    table reads grpod's own cumulative share beside it."""
    eos = {0}
    scores = [1.0, 1.0, 1.0,  0.0, 0.5, 1.0,  0.0, 0.0, 1.0]
    ids = [[5, 0], [5, 0], [5, 0],  [5, 6, 0], [5, 0], [5, 6, 7],  [5, 0], [5, 6, 0], [5, 0]]
    # Group 2: the 0.5 completion sits at the mean; [5, 6, 7] ran to max_tokens 3 without EOS.
    assert workload.gradient_tokens(scores, ids, 3, 3, eos, mask_truncated=True) == 3 + 2 + 3 + 2
    assert workload.gradient_tokens(scores, ids, 3, 3, eos, mask_truncated=False) == 3 + 3 + 2 + 3 + 2
    with pytest.raises(ValueError, match="not whole groups of 4"):
        workload.gradient_tokens(scores, ids, 4, 3, eos, mask_truncated=True)
    trl = compare.Run(side="trl", seed=0, run_dir=tmp_path, launch=0.0, threads=2)
    trl.steps = [{"step": 1, "time": 10.0, "tokens": 100, "gradient": 30}, {"step": 2, "time": 20.0, "tokens": 100, "gradient": 50}]
    grpod = compare.Run(side="grpod", seed=0, run_dir=tmp_path, launch=0.0)
    grpod.steps = [{"step": 1, "time": 5.0, "tokens": 80, "sampled": 100, "share": 0.5},
                   {"step": 2, "time": 9.0, "tokens": 80, "sampled": 200, "share": 0.62}]
    _, summary = compare.table([grpod, trl], ["grpod", "trl"], [])
    assert summary["rows"]["share of sampled completion tokens that reached a gradient (launch to last step)"] == {
        "grpod": "0.620", "trl": "0.400"}


def test_the_format_tasks_rows_open_with_the_worked_exchange(tmp_path, monkeypatch):
    """`--task format`'s rows: each prompt of `grpod reasoning-gym`'s rows becomes chat messages
    after the one worked exchange in the tagged format; the verifier's column rides along."""
    (tmp_path / "rows").mkdir()
    for name in ("train.jsonl", "eval.jsonl"):
        (tmp_path / "rows" / name).write_text(json.dumps({"prompt": f"{name}: 1 + 2 =", "answer": "3", "reasoning_gym": "{}"}) + "\n")
    monkeypatch.setattr(compare, "FORMAT_DATA", tmp_path)
    compare._one_shot_rows()
    row = json.loads((tmp_path / "eval.jsonl").read_text())
    assert row["messages"] == [*compare.FORMAT_SHOT, {"role": "user", "content": "eval.jsonl: 1 + 2 ="}]
    assert (row["answer"], row["reasoning_gym"]) == ("3", "{}") and "prompt" not in row
    assert "<answer>" in compare.FORMAT_SHOT[-1]["content"]
    assert compare.TASKS["format"].convert is compare.TASKS["format-plain"].convert is compare._one_shot_rows


def test_the_levels_task_prepares_the_held_out_rows_it_is_scored_on_first_and_refuses_a_trl_side(tmp_path, monkeypatch):
    """`--task reasoning-gym-number-levels`: reasoning-gym-number's files are written first (its
    held-out rows score the run, and --exclude keeps them out of the levels), then the levels; the
    config draws them by curriculum, which TRL has no counterpart for."""
    task = compare.TASKS["reasoning-gym-number-levels"]
    written = []
    monkeypatch.setattr(compare.subprocess, "run", lambda argv, **kw: written.append(argv[argv.index("--out") + 1]))
    monkeypatch.setattr(compare, "TASKS", {**compare.TASKS, "reasoning-gym-number": replace(
        compare.TASKS["reasoning-gym-number"], data=tmp_path / "none.jsonl")})
    monkeypatch.setattr(compare, "_grpod", lambda: ["grpod"])
    compare._prepare(replace(task, data=tmp_path / "levels.jsonl"))
    assert written == [str(compare.ROOT / "data" / "chain_sum"), str(compare.LEVELS_DATA)]
    assert "--exclude" in task.prepare and task.prepare.count("--level") == 4
    cfg = workload.load(task.config, list(task.overrides))
    assert cfg.source.dataset.curriculum is not None and cfg.source.dataset.rest_epochs == 0
    assert cfg.eval.dataset == Path("data/chain_sum/eval.jsonl")
    with pytest.raises(workload.WorkloadError, match="source.dataset.curriculum"):
        workload.grpo_config_kwargs(cfg, completion_tokens=8)


def test_pool_joins_seeds_run_at_different_times_into_one_paired_table(tmp_path):
    """bench/peers/pool.py: seeds from two invocations are pooled (rows added for the Wilson
    interval, per-row outcomes paired over the seeds that kept them); a seed in two files is refused."""
    pool = bench_module("pool")
    n = 100

    def run(side, seed, rows, keep_rows=True):
        saved = {"minutes": 10.0, "step": 7, "correct": sum(rows), "size": n, "accuracy": sum(rows) / n}
        return {"side": side, "seed": seed, "steps": 9, "sampled_tokens_per_s": 50.0, "gradient_token_share": 0.5,
                "saved": [{**saved, **({"rows": rows} if keep_rows else {})}]}

    def write(name, runs):
        path = tmp_path / name
        path.write_text(json.dumps({"task": "t", "sides": ["grpod", "trl"], "runs": runs,
                                    "start_accuracy": {"correct": 15, "size": n, "accuracy": 0.15}}))
        return path

    unscored = run("grpod", 0, [1] * 30 + [0] * 70)
    unscored["saved"].append({"minutes": 15.0, "step": 9})  # saved, but its evaluation failed
    first = write("seed0.json", [unscored, run("trl", 0, [1] * 20 + [0] * 80)])
    second = write("seed1.json", [run("grpod", 1, [1] * 40 + [0] * 60), run("trl", 1, [1] * 20 + [0] * 80),
                                  run("grpod", 2, [1] * 50 + [0] * 50, keep_rows=False),
                                  run("trl", 2, [1] * 10 + [0] * 90, keep_rows=False)])
    pooled = pool.pool(*pool.load([first, second]))
    (mark,) = pooled["marks"]
    assert mark["per_seed"] == {"grpod": [0.3, 0.4, 0.5], "trl": [0.2, 0.2, 0.1]}
    assert mark["pooled"]["grpod"]["correct"] == 120 and mark["pooled"]["grpod"]["size"] == 300
    assert mark["pooled"]["trl"]["wilson"] == pool.wilson(50, 300)
    # Seeds 0 and 1 kept their rows: per row, grpod - trl averages over them to 1 (rows 20-29) and
    # 0.5 (rows 30-39), 0 elsewhere, so the mean is 0.15 over 100 rows; seed 2 is left out.
    paired = mark["paired"]
    assert paired["seeds"] == [0, 1] and paired["rows"] == n
    assert (paired["mean"], paired["low"], paired["high"]) == pool.paired_difference(
        [([1] * 30 + [0] * 70, [1] * 20 + [0] * 80), ([1] * 40 + [0] * 60, [1] * 20 + [0] * 80)])
    assert abs(paired["mean"] - 0.15) < 1e-12 and paired["low"] > 0
    text = pool.markdown(pooled)
    assert "0.400 [0.346, 0.456] (120/300)" in text and "steps by 10 min, per seed | 7 / 7 / 7" in text
    with pytest.raises(SystemExit, match="grpod seed 1 is in"):
        pool.load([second, write("again.json", [run("grpod", 1, [0] * n)])])


def test_pool_renames_a_grpod_only_run_into_a_side_of_its_own_paired_first(tmp_path):
    """--rename: a grpod-only invocation with another setting (FILE:grpod=NAME) becomes its own
    side, first in the table, paired against the next side (the same seed's grpod)."""
    pool = bench_module("pool")
    n = 100

    def write(name, sides, runs):
        path = tmp_path / name
        path.write_text(json.dumps({"task": "t", "sides": sides, "runs": [
            {"side": side, "seed": 0, "saved": [{"minutes": 10.0, "step": 5, "correct": sum(rows), "size": n,
                                                 "accuracy": sum(rows) / n, "rows": rows}]} for side, rows in runs]}))
        return path

    both = write("seed0.json", ["grpod", "trl"], [("grpod", [1] * 30 + [0] * 70), ("trl", [1] * 20 + [0] * 80)])
    other = write("frontier-seed0.json", ["grpod"], [("grpod", [1] * 40 + [0] * 60)])
    with pytest.raises(SystemExit, match="grpod seed 0 is in"):
        pool.load([both, other])
    renames = pool.parse_renames([f"{other}:grpod=grpod frontier"])
    pooled = pool.pool(*pool.load([both, other], renames))
    (mark,) = pooled["marks"]
    assert pooled["sides"] == ["grpod frontier", "grpod", "trl"]
    assert mark["per_seed"] == {"grpod frontier": [0.4], "grpod": [0.3], "trl": [0.2]}
    assert mark["paired"]["minus"] == "grpod frontier - grpod" and abs(mark["paired"]["mean"] - 0.1) < 1e-12
    with pytest.raises(SystemExit, match="expected FILE:SIDE=NAME"):
        pool.parse_renames(["frontier-seed0.json=grpod"])


def test_pool_joins_another_task_only_when_its_starting_model_scored_the_same_rows_alike(tmp_path):
    """A task with another training set (the levels) pools with the one whose held-out rows it is
    scored on; a task whose starting model's per-row outcomes differ is refused."""
    pool = bench_module("pool")
    start = [1, 0, 0, 1] * 25

    def write(name, task, start_rows):
        path = tmp_path / name
        path.write_text(json.dumps({"task": task, "sides": ["grpod"], "start_accuracy": {"rows": start_rows}, "runs": [
            {"side": "grpod", "seed": 0, "saved": [{"minutes": 10.0, "step": 5, "correct": 50, "size": 100,
                                                    "accuracy": 0.5, "rows": [1, 0] * 50}]}]}))
        return path

    base = write("base.json", "reasoning-gym-number", start)
    levels = write("levels.json", "reasoning-gym-number-levels", start)
    other = write("other.json", "format", [1 - x for x in start])
    header, runs = pool.load([base, levels], pool.parse_renames([f"{levels}:grpod=grpod levels"]))
    assert header["sides"] == ["grpod levels", "grpod"] and set(runs) == {("grpod levels", 0), ("grpod", 0)}
    with pytest.raises(SystemExit, match="is task 'format'.*did not score the same held-out rows alike"):
        pool.load([base, other])
