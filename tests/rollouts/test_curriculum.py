"""source.dataset.curriculum: rows carry a difficulty level and the level drawn follows the running
pass rate. The decision rule and the streams alone, then through the dataset source with a
scripted client standing in for vLLM (the end-to-end run with the real model is the peer bench)."""

from __future__ import annotations

import json

import anyio
import pytest

from grpod.config import ConfigError, CurriculumConfig, parse_config
from grpod.daemon.control import ControlError
from grpod.daemon.desk import OperatorDesk
from grpod.daemon.progress import RunProgress
from grpod.inference.client import Completion
from grpod.rollouts.curriculum import Curriculum
from grpod.rollouts.dataset import DatasetError
from tests.rollouts.test_dataset import ScriptedClient, open_source, tokenizer, write_jsonl  # noqa: F401 (fixture)

LEVELS = [0] * 4 + [1] * 4 + [2] * 4  # item i's level


def curriculum(cursor=None, **cfg) -> Curriculum:
    return Curriculum(CurriculumConfig(**{"window": 3, **cfg}), LEVELS, seed=7, cursor=cursor)


def test_a_full_window_above_the_band_moves_up_below_moves_down_and_inside_stays():
    c = curriculum()
    assert c.level == 0
    for _ in range(2):
        c.record(0, 1.0)
    assert c.level == 0  # the window is not full yet
    c.record(0, 0.9)
    assert c.level == 1 and c.moves_up == 1 and c.describe()["window_groups"] == 0
    c.record(0, 0.0)  # drawn at level 0, in flight across the move: not counted
    assert c.describe()["window_groups"] == 0
    for rate in (0.5, 0.4, 0.6, 0.5, 0.5):  # inside the band, the window sliding: stays
        c.record(1, rate)
    assert c.level == 1 and c.describe()["window_pass_rate"] == pytest.approx(0.5333, abs=1e-4)
    for _ in range(3):
        c.record(1, 1.0)
    assert c.level == 2
    for _ in range(6):  # the hardest level passed: nowhere further up
        c.record(2, 1.0)
    assert c.level == 2 and c.moves_up == 2
    for _ in range(3):
        c.record(2, 0.1)
    assert c.level == 1 and c.moves_down == 1
    low = curriculum(start=0)
    for _ in range(5):  # the easiest level failed: nowhere further down
        low.record(0, 0.0)
    assert low.level == 0 and low.moves_down == 0


def test_each_level_is_its_own_shuffled_endless_stream_and_a_resumed_cursor_draws_the_same():
    c = curriculum(start=1)
    drawn = [c.draw() for _ in range(10)]
    assert {level for _, level in drawn} == {1}
    indices = [i for i, _ in drawn]
    assert sorted(indices[:4]) == sorted(indices[4:8]) == [4, 5, 6, 7]  # one pass visits each row once
    assert sorted(indices[8:] + [c.draw()[0] for _ in range(2)]) == [4, 5, 6, 7]  # the third pass ends
    passes = {tuple(c.draw()[0] for _ in range(4)) for _ in range(5)}  # the later passes, each reshuffled
    assert len(passes) > 1 and all(sorted(order) == [4, 5, 6, 7] for order in passes)
    for _ in range(3):
        c.record(1, 1.0)
    assert c.level == 2 and c.draw()[1] == 2 and c.draws == {1: 32, 2: 1}
    c.record(2, 0.2)
    cursor = json.loads(json.dumps(c.cursor()))  # as a checkpoint stores it
    resumed = curriculum(cursor=cursor)
    assert resumed.peek(9) == c.peek(9)
    assert [resumed.draw() for _ in range(9)] == [c.draw() for _ in range(9)]
    for _ in range(2):  # the window came along: two more groups fill it
        c.record(2, 0.0)
        resumed.record(2, 0.0)
    assert c.level == resumed.level == 1
    assert resumed.describe() == c.describe()
    with pytest.raises(ValueError, match=r"curriculum.start = 5: no row has that level; the levels are \[0, 1, 2\]"):
        curriculum(start=5)


def test_a_cursor_is_a_snapshot_the_draws_after_it_do_not_change():
    """A checkpoint takes the cursor, then serialises it in a worker thread while the fetch task
    draws on: the streams' positions were the live lists, so the checkpoint recorded positions
    past its buffered groups and `draws`, and a resume skipped the rows drawn meanwhile."""
    c = curriculum(start=1)
    for _ in range(3):
        c.draw()
    taken = c.cursor()
    frozen = json.loads(json.dumps(taken))
    for _ in range(4):
        c.draw()
    assert taken == frozen, (taken, frozen)


# ---- through the dataset source --------------------------------------------------------------

# Level 0: "a+a=" with a in 0-3, level 1: 10-13, level 2: 20-23 (the client reads a's tens).
ROWS = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "level": a // 10} for a in (0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23)]


class SkillClient(ScriptedClient):
    """Always right on level 0, right on every other completion at level 1, never at level 2."""

    async def generate(self, prompt_ids, *, n, **kwargs):
        a = int(self.tokenizer.decode(prompt_ids).split("user\n")[1].split("+")[0])
        level = a // 10
        texts = [str(2 * a) if level == 0 or (level == 1 and i % 2) else "x" for i in range(n)]
        out = []
        for text in texts:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            out.append(Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", text=text))
        return out


def _config(path, **curriculum):
    return parse_config({
        "source": {"kind": "dataset", "group_size": 4, "dataset": {
            "path": str(path), "rewards": [{"function": "exact"}], "shuffle_seed": 2,
            "curriculum": {"window": 2, **curriculum}}},
    })


def _play(tokenizer, cfg, groups, cursor=None):
    """The source of `cfg` after `groups` groups, and each group's (level, file row)."""
    async def main():
        src = await open_source(tokenizer, cfg, cursor=cursor, client_class=SkillClient)
        ids = [(await src.generate_group()).group_id.split("-") for _ in range(groups)]
        return src, [(level, int(row)) for _, level, row in ids]

    return anyio.run(main)


def test_the_source_climbs_to_the_level_passed_half_the_time_and_resumes_there(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    src, drawn = _play(tokenizer, _config(path), 8)
    # Two groups at level 0 (all passed) -> level 1, passed half the time: it stays there.
    assert [level for level, _ in drawn] == ["L0", "L0"] + ["L1"] * 6
    assert all(ROWS[row]["level"] == int(level[1]) for level, row in drawn)
    assert sorted(row for _, row in drawn[2:6]) == [4, 5, 6, 7]  # level 1's stream: each row once a pass
    status = src.stats.curriculum
    assert status["level"] == 1 and status["moves_up"] == 1 and status["draws"] == {0: 2, 1: 6}
    assert status["window_pass_rate"] == 0.5 and src.stats.step_metrics()["curriculum_level"] == 1
    cursor = json.loads(json.dumps(src.cursor()))  # as a checkpoint stores it
    _, uninterrupted = _play(tokenizer, _config(path), 14)
    resumed, after = _play(tokenizer, _config(path), 6, cursor=cursor)
    assert after == uninterrupted[8:] and resumed.stats.curriculum["draws"] == {0: 2, 1: 12}

    _, hard = _play(tokenizer, _config(path, start=2), 6)  # never passed -> down to level 1, and stays
    assert [level for level, _ in hard] == ["L2", "L2"] + ["L1"] * 4


def test_the_pass_rate_leaves_out_completions_no_function_could_score(tmp_path, tokenizer):
    """A reward answering None (no answer to read) leaves a completion out of the trainer's
    statistics; the curriculum counted it a failure. At level 1 every scored completion passes,
    so the source climbs on to level 2 (it stayed, at a pass rate of one half)."""
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    module = tmp_path / "answered.py"
    module.write_text("def answered(completions, answer, **kwargs):\n"
                      "    return [None if c == 'x' else float(c == a) for c, a in zip(completions, answer)]\n")
    cfg = parse_config({
        "source": {"kind": "dataset", "group_size": 4, "dataset": {
            "path": str(path), "rewards": [{"function": f"{module}:answered"}], "shuffle_seed": 2,
            "curriculum": {"window": 2}}},
    })
    src, drawn = _play(tokenizer, cfg, 4)
    assert [level for level, _ in drawn] == ["L0", "L0", "L1", "L1"], drawn
    assert src.curriculum.level == 2, src.curriculum.describe()


def test_a_level_column_that_is_missing_or_not_an_integer_and_a_curriculum_with_epochs_are_refused(tmp_path, tokenizer):
    cases = {
        "missing": ([{k: v for k, v in r.items() if k != "level"} for r in ROWS], "needs a 'level' column"),
        "string": ([*ROWS[:3], {**ROWS[3], "level": "hard"}], "row 4, column 'level': expected an integer difficulty level, got 'hard'"),
        "empty": ([*ROWS[:2], {**ROWS[2], "level": None}], "row 3, column 'level': expected an integer difficulty level, got None"),
        "bool": ([*ROWS[:5], {**ROWS[5], "level": True}], "row 6, column 'level': expected an integer"),
        "float": ([{**ROWS[0], "level": 1.5}, *ROWS[1:]], "row 1, column 'level': expected an integer"),
    }
    for name, (rows, message) in cases.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        with pytest.raises(DatasetError, match=message):
            anyio.run(open_source, tokenizer, _config(path))
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{k: v for k, v in r.items() if k != "level"} for r in ROWS])
    cfg = _config(path)
    cfg.eval.dataset = held_out  # held-out rows need no level
    assert len(anyio.run(open_source, tokenizer, cfg).eval_items) == len(ROWS)
    with pytest.raises(DatasetError, match="curriculum.start = 7: no row has that level"):
        anyio.run(open_source, tokenizer, _config(path, start=7))
    for key in ("epochs", "rest_epochs"):
        with pytest.raises(ConfigError, match="curriculum .* needs epochs = 0 and rest_epochs = 0"):
            parse_config({"source": {"kind": "dataset", "dataset": {
                "path": str(path), "rewards": [{"function": "exact"}], key: 2, "curriculum": {}}}})
    with pytest.raises(ConfigError, match=r"band \[0.8, 0.2\]: expected \[low, high\]"):
        _config(path, band=[0.8, 0.2])


EPOCH_SPY = '''
def epoch(completions, trainer_state, log_metric, **kwargs):
    log_metric("epoch", trainer_state.epoch)
    return [0.0] * len(completions)
'''


def test_trainer_state_epoch_is_the_rows_drawn_over_the_set_with_and_without_levels(tmp_path, tokenizer):
    """A reward function reads `trainer_state.epoch` as TRL hands it: passes over the set so far,
    a fraction; under a curriculum, every level's draws (the level is not an epoch)."""
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)  # 12 rows
    (tmp_path / "spy.py").write_text(EPOCH_SPY)
    rewards = [{"function": "exact"}, {"function": f"{tmp_path / 'spy.py'}:epoch", "weight": 0.0}]

    def epochs(curriculum, groups):
        cfg = parse_config({"source": {"kind": "dataset", "group_size": 4, "dataset": {
            "path": str(path), "rewards": rewards, "shuffle_seed": 2,
            **({"curriculum": {"window": 2}} if curriculum else {})}}})

        async def main():
            src = await open_source(tokenizer, cfg, client_class=SkillClient)
            try:
                return [(await src.generate_group()).extra["reward_logged"]["epoch"] for _ in range(groups)]
            finally:
                await src.aclose()

        return anyio.run(main)

    assert epochs(False, 18) == pytest.approx([n / 12 for n in range(1, 19)])  # into the second pass
    assert epochs(True, 8) == pytest.approx([n / 12 for n in range(1, 9)])  # two at level 0, six at 1


def test_ctl_set_moves_a_running_curriculums_band_and_window_and_refuses_what_does_not_fit(tmp_path, tokenizer):
    """`source.dataset.curriculum.band` and `.window` are live: queued by the operator desk as
    `ctl set` queues them, applied at a boundary, and the next group is judged by them."""
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    cfg = _config(path)  # window 2, band [0.3, 0.7]

    async def main():
        src = await open_source(tokenizer, cfg, client_class=SkillClient)
        desk = OperatorDesk(cfg, RunProgress(cfg.train.steps))

        async def levels(groups):
            return [(await src.generate_group()).group_id.split("-")[1] for _ in range(groups)]

        before = await levels(4)
        with pytest.raises(ControlError, match=r"band \[0.8, 0.2\]: expected \[low, high\]"):
            await desk.ctl_set({"key": "source.dataset.curriculum.band", "value": [0.8, 0.2]})
        await desk.ctl_set({"key": "source.dataset.curriculum.band", "value": [0.6, 1.0]})
        await desk.ctl_set({"key": "source.dataset.curriculum.window", "value": 3})
        assert await levels(1) == ["L1"], "nothing applies before the boundary"
        applied = desk.apply_changes(1, lambda change: None)
        assert [(c["key"], c["new"]) for c in applied] == [("source.dataset.curriculum.band", [0.6, 1.0]),
                                                           ("source.dataset.curriculum.window", 3)]
        return before, await levels(5), src.stats.curriculum

    before, after, status = anyio.run(main)
    assert before == ["L0", "L0", "L1", "L1"]  # 1.0 > 0.7: up; 0.5 inside [0.3, 0.7]: stays
    # Level 1's window (three groups at 0.5) is below 0.6: down; level 0 at 1.0 is not above 1.0: stays.
    assert after == ["L1", "L0", "L0", "L0", "L0"]
    assert status["moves_down"] == 1 and status["window_groups"] == 3

    plain = parse_config({"source": {"kind": "dataset", "dataset": {"path": str(path), "rewards": [{"function": "exact"}]}}})
    with pytest.raises(ControlError, match="source.dataset.curriculum.band: no such key"):
        anyio.run(OperatorDesk(plain, RunProgress(plain.train.steps)).ctl_set,
                  {"key": "source.dataset.curriculum.band", "value": [0.2, 0.8]})
