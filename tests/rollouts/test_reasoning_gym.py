"""A reasoning-gym task through the dataset source: `grpod reasoning-gym` writes the rows (the
real reasoning-gym package generates them), the builtin reward `reasoning_gym` scores completions
with the task's own verifier, in the reward pool as a daemon runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio

from grpod.config import parse_config
from grpod.rollouts.dataset import DatasetError, prepare_dataset
from grpod.rollouts.rewards import reasoning_gym_reward

import pytest


def _write(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "grpod", "reasoning-gym", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_the_command_writes_train_and_disjoint_held_out_rows_and_refuses_a_bad_task(tmp_path):
    done = _write(tmp_path, "chain_sum", "--out", "cs", "--size", "300", "--eval-size", "120", "--seed", "3",
                  "--option", "max_terms=2", "--option", "max_digits=2")
    assert done.returncode == 0, done.stderr
    train = [json.loads(line) for line in (tmp_path / "cs/train.jsonl").read_text().splitlines()]
    held_out = [json.loads(line) for line in (tmp_path / "cs/eval.jsonl").read_text().splitlines()]
    assert len(train) == 300 and len(held_out) == 120
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert len({r["prompt"] for r in held_out}) == 120
    entry = json.loads(train[0]["reasoning_gym"])
    assert entry["question"] == train[0]["prompt"] and entry["answer"] == train[0]["answer"]
    assert entry["metadata"]["source_dataset"] == "chain_sum" and entry["metadata"]["num_terms"] == 2
    again = _write(tmp_path, "chain_sum", "--out", "again", "--size", "300", "--eval-size", "120", "--seed", "3",
                   "--option", "max_terms=2", "--option", "max_digits=2")
    assert (tmp_path / "again/train.jsonl").read_bytes() == (tmp_path / "cs/train.jsonl").read_bytes(), again.stderr

    bad = _write(tmp_path, "no_such_task", "--out", "x")
    assert bad.returncode == 2 and "'no_such_task'" in bad.stderr and "not registered" in bad.stderr
    option = _write(tmp_path, "chain_sum", "--out", "x", "--option", "colour=3")
    assert option.returncode == 2 and "colour" in option.stderr
    small = _write(tmp_path, "chain_sum", "--out", "x", "--size", "400", "--option", "max_terms=2", "--option", "max_digits=1")
    assert small.returncode == 2 and "no more questions outside the" in small.stderr


def test_levels_write_a_level_column_and_held_out_rows_of_one_level_and_exclude_keeps_questions_out(tmp_path):
    """--level: --size rows per level with its options over --option, the held-out rows from the
    last level unless --eval-level says; --exclude: another file's questions in neither split."""
    first = _write(tmp_path, "chain_sum", "--out", "one", "--size", "40", "--eval-size", "60",
                   "--option", "max_terms=2", "--option", "max_digits=2")
    assert first.returncode == 0, first.stderr
    done = _write(tmp_path, "chain_sum", "--out", "lv", "--size", "50", "--eval-size", "30", "--option", "max_terms=2",
                  "--level", "max_digits=1", "--level", "min_digits=3,max_digits=3", "--exclude", "one/eval.jsonl")
    assert done.returncode == 0, done.stderr
    train = [json.loads(line) for line in (tmp_path / "lv/train.jsonl").read_text().splitlines()]
    held_out = [json.loads(line) for line in (tmp_path / "lv/eval.jsonl").read_text().splitlines()]
    assert [r["level"] for r in train] == [0] * 50 + [1] * 50 and {r["level"] for r in held_out} == {1}

    def digits(row):
        return {len(str(abs(int(t)))) for t in row["prompt"].rpartition(":")[2].strip(" =").replace("-", "+").split("+")}

    assert set().union(*(digits(r) for r in train[:50])) == {1}
    assert set().union(*(digits(r) for r in train[50:] + held_out)) == {3}
    excluded = {json.loads(line)["prompt"] for line in (tmp_path / "one/eval.jsonl").read_text().splitlines()}
    assert not excluded & {r["prompt"] for r in train + held_out}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    easiest = _write(tmp_path, "chain_sum", "--out", "lv0", "--size", "20", "--eval-size", "10", "--option", "max_terms=2",
                     "--level", "max_digits=1", "--level", "min_digits=3,max_digits=3", "--eval-level", "0")
    assert easiest.returncode == 0, easiest.stderr
    rows = [json.loads(line) for line in (tmp_path / "lv0/eval.jsonl").read_text().splitlines()]
    assert {r["level"] for r in rows} == {0} and set().union(*(digits(r) for r in rows)) == {1}
    wrong = _write(tmp_path, "chain_sum", "--out", "x", "--level", "max_digits=1", "--eval-level", "1")
    assert wrong.returncode == 2 and "--eval-level 1: there are 1 levels" in wrong.stderr
    (tmp_path / "bad.jsonl").write_text('{"question": "x"}\n')
    missing = _write(tmp_path, "chain_sum", "--out", "x", "--exclude", "bad.jsonl")
    assert missing.returncode == 2 and "bad.jsonl: row 1: no string `prompt`" in missing.stderr
    unreadable = _write(tmp_path, "chain_sum", "--out", "x", "--exclude", "none.jsonl")
    assert unreadable.returncode == 2 and "--exclude none.jsonl: no such dataset file" in unreadable.stderr


def test_the_builtin_reward_is_the_tasks_verifier_on_the_tagged_answer(tmp_path):
    assert _write(tmp_path, "chain_sum", "--out", "cs", "--size", "5", "--eval-size", "0").returncode == 0
    row = json.loads((tmp_path / "cs/train.jsonl").read_text().splitlines()[0])
    gold = row["answer"]
    completions = [f"I add them. <answer>{gold}</answer>", "<answer>123456789</answer>", gold,
                   f"the sum is {gold} I think", ""]
    rewards = reasoning_gym_reward(completions, reasoning_gym=[row["reasoning_gym"]] * 5)
    assert rewards[0] == 1.0 and rewards[1] == 0.0 and rewards[2] == 1.0 and rewards[4] == 0.0
    assert 0.0 < rewards[3] < 1.0  # the task's partial credit for an answer inside other text
    with pytest.raises(KeyError, match="reasoning_gym"):
        reasoning_gym_reward(completions, answer=[gold] * 5)


def test_the_builtin_reward_reads_the_answer_where_its_pattern_says(tmp_path):
    """pattern = the last match (its group if it has one) is the answer the verifier sees: an
    equation that ends in the right sum earns full credit, which the default reading gives only
    partial credit; nothing matched is no answer."""
    assert _write(tmp_path, "chain_sum", "--out", "cs", "--size", "5", "--eval-size", "0",
                  "--option", "max_terms=2", "--option", "max_digits=2").returncode == 0
    row = json.loads((tmp_path / "cs/train.jsonl").read_text().splitlines()[0])
    gold, entries = row["answer"], [row["reasoning_gym"]] * 4
    question = row["prompt"].rpartition(":")[2].strip()  # "12 + 34 ="
    completions = [f"{question} {gold}", f"{question} {int(gold) + 1}", "I cannot say.", f"<answer>{gold}</answer>"]
    default = reasoning_gym_reward(completions, reasoning_gym=entries)
    assert 0.0 < default[0] < 1.0 and default[3] == 1.0
    last_number = reasoning_gym_reward(completions, pattern=r"-?\d+", reasoning_gym=entries)
    assert last_number == [1.0, 0.0, 0.0, 1.0]
    grouped = reasoning_gym_reward([f"so = {gold}.", f"= {gold}0"], pattern=r"=\s*(-?\d+)\.",
                                   reasoning_gym=entries[:2])
    assert grouped == [1.0, 0.0]


def test_the_dataset_source_loads_the_rows_and_names_a_missing_entry_column(tmp_path):
    assert _write(tmp_path, "basic_arithmetic", "--out", "ba", "--size", "20", "--eval-size", "10").returncode == 0
    rewards = [{"function": "reasoning_gym"}, {"function": "regex_format", "pattern": "<answer>.*</answer>", "weight": 0.2}]
    cfg = parse_config({"source": {"kind": "dataset", "dataset": {"path": str(tmp_path / "ba/train.jsonl"),
                                                                  "rewards": rewards}},
                        "eval": {"dataset": str(tmp_path / "ba/eval.jsonl")}})

    async def main():
        prepared = await prepare_dataset(cfg)
        try:
            return len(prepared.rows), len(prepared.eval_rows)
        finally:
            await prepared.scorer.aclose()

    assert anyio.run(main) == (20, 10)
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in
                            map(json.loads, (tmp_path / "ba/train.jsonl").read_text().splitlines())))
    cfg = parse_config({"source": {"kind": "dataset", "dataset": {"path": str(bare), "rewards": rewards}}})
    with pytest.raises(DatasetError, match="reasoning_gym"):
        anyio.run(prepare_dataset, cfg)


def test_the_pattern_reaches_the_reward_pool_that_runs_the_verifier(tmp_path):
    """As a daemon scores: the function's pattern travels to the worker that imports reasoning-gym."""
    from grpod.config import RewardFunctionConfig
    from grpod.rollouts.rewards import TrainerState, reward_functions
    from grpod.rollouts.scoring import RewardCall, RewardScorer

    assert _write(tmp_path, "chain_sum", "--out", "cs", "--size", "5", "--eval-size", "0").returncode == 0
    row = json.loads((tmp_path / "cs/train.jsonl").read_text().splitlines()[0])
    completions = [f"it is {row['answer']}", f"it is {int(row['answer']) + 1}"]
    functions = reward_functions([RewardFunctionConfig(function="reasoning_gym", pattern=r"-?\d+")])
    call = RewardCall(prompts=[row["prompt"]] * 2, completions=completions, completion_ids=[[1]] * 2,
                      columns={"reasoning_gym": [row["reasoning_gym"]] * 2}, trainer_state=TrainerState())

    async def main():
        scorer = RewardScorer(functions, aggregation="sum", timeout_s=60.0, workers=1, memory_mb=1024)
        await scorer.start()
        try:
            return await scorer.score(call)
        finally:
            await scorer.aclose()

    assert anyio.run(main).scores == [1.0, 0.0]
