"""The dataset source without vLLM: loading the three formats, row errors, order and cursor,
epochs, reward failures dropping groups, evaluation. A scripted client stands in for vLLM.

A source whose functions run in the reward pool lives in one event loop (its workers' pipes do):
those tests run their whole body in one `anyio.run` and close the source at its end."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import anyio
import pytest

from grpod.config import ConfigError, parse_config
from grpod.daemon.desk import OperatorDesk
from grpod.daemon.progress import RunProgress
from grpod.inference.client import Completion
from grpod.models.tiny import build_tokenizer
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.dataset import DatasetError, DatasetSource, prepare_dataset, read_rows
from grpod.rollouts.kinds import make_source
from grpod.rollouts.validation import RejectionCounter
from tests.rollouts.conftest import scripted_policy

ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(12)]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def config(path: Path, rewards=({"function": "exact"},), **source):
    dataset = {"path": str(path), "rewards": list(rewards), **source.pop("dataset", {})}
    eval_ = source.pop("eval", {})
    return parse_config({"source": {"kind": "dataset", "group_size": 2, **source, "dataset": dataset}, "eval": eval_})


class ScriptedClient:
    """Answers every prompt with `answer_for(prompt_text)`, decoded by the test's tokenizer."""

    def __init__(self, tokenizer, answer_for):
        self.tokenizer, self.answer_for, self.requests = tokenizer, answer_for, []

    async def generate(self, prompt_ids, *, n, max_tokens, temperature, top_p=1.0, model="policy", **_):
        self.requests.append({"n": n, "temperature": temperature, "max_tokens": max_tokens})
        text = self.answer_for(self.tokenizer.decode(prompt_ids))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return [Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", text=text) for _ in range(n)]


def right_answer(prompt_text: str) -> str:
    a = int(prompt_text.split("user\n")[1].split("+")[0])
    return str(2 * a)


async def open_source(tokenizer, cfg, answer_for=right_answer, cursor=None, client_class=None) -> DatasetSource:
    """The source of `cfg`, its inputs checked as the daemon checks them (`prepare_dataset`);
    the caller closes it (`await src.aclose()`) when its functions run in the reward pool."""
    client = (client_class or ScriptedClient)(tokenizer, answer_for)
    prepared = await prepare_dataset(cfg, tokenizer=tokenizer)
    src = make_source(cfg, tokenizer, scripted_policy(client, version=3)[0], cursor, RejectionCounter(), prepared)
    src.client = client
    return src


def source(tokenizer, cfg, answer_for=right_answer, cursor=None) -> DatasetSource:
    """`open_source` for in-process functions (exact, last_number): no worker, any event loop."""
    src = anyio.run(open_source, tokenizer, cfg, answer_for, cursor)
    assert src.scorer.pool is None, "a pooled source must run in one event loop: use open_source"
    return src


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_the_three_formats_load_the_same_rows(tmp_path, tokenizer, suffix):
    import datasets

    path = tmp_path / f"train{suffix}"
    table = datasets.Dataset.from_list(ROWS)
    {".jsonl": lambda: write_jsonl(path, ROWS), ".parquet": lambda: table.to_parquet(str(path)),
     ".csv": lambda: table.to_csv(str(path), index=False)}[suffix]()
    src = source(tokenizer, config(path))
    assert len(src.items) == len(ROWS)
    item = src.items[5]
    # Each value as written: CSV cells are text, JSONL and Parquet keep the string.
    assert item.columns == {"answer": "10"}
    # The tiny tokenizer has a chat template: the prompt is a user turn with the assistant turn opened.
    assert item.prompt_text == "<|im_start|>user\n5+5=<|im_end|>\n<|im_start|>assistant\n"
    assert item.prompt_ids == tokenizer.encode(item.prompt_text, add_special_tokens=False)


def test_messages_rows_and_the_system_prompt_render_through_the_chat_template(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "1+1="}], "answer": "2"}])
    src = source(tokenizer, config(path, dataset={"system_prompt": "Add."}))
    assert src.items[0].prompt_text == (
        "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    )


def test_without_a_chat_template_the_prompt_is_plain_text(tmp_path, tokenizer):
    plain = build_tokenizer()
    plain.chat_template = None
    path = write_jsonl(tmp_path / "t.jsonl", ROWS[:2])
    src = source(plain, config(path, dataset={"system_prompt": "Add."}))
    assert src.items[1].prompt_text == "Add.\n\n1+1="


def test_a_row_the_chat_template_refuses_is_a_dataset_error_naming_it(tmp_path, tokenizer):
    """A strict template (roles must alternate, no system role) raises jinja2's TemplateError:
    it was a traceback at check-config, naming no file, row or column."""
    from grpod.rollouts.dataset import DatasetError

    strict = build_tokenizer()
    strict.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    rows = [{"messages": [{"role": "user", "content": "1+1="}], "answer": "2"},
            {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "2+2="}], "answer": "4"}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(DatasetError) as caught:
        source(strict, config(path))
    message = str(caught.value)
    assert "row 2" in message and "column 'messages'" in message and "chat template refused it" in message, message
    assert "Conversation roles must alternate" in message


def test_reward_functions_get_the_trainers_step_as_global_step_and_the_sampling_version(tmp_path, tokenizer):
    """TRL's `global_step` counts optimizer steps; it was the policy version, which counts syncs
    (with bridge.sync_every = 4 it reached a quarter of max_steps), so a reward annealed over
    global_step / max_steps ran on the wrong schedule."""
    module = tmp_path / "seen.py"
    module.write_text("def seen(completions, trainer_state, **kwargs):\n"
                      "    s = trainer_state\n"
                      "    return [s.global_step * 10000 + s.policy_version * 100 + s.max_steps for _ in completions]\n")
    path = write_jsonl(tmp_path / "t.jsonl", ROWS[:2])
    cfg = config(path, rewards=({"function": f"{module}:seen"},))
    cfg.train.steps = 40

    async def main():
        src = await open_source(tokenizer, cfg)
        try:
            src.policy.trainer_step = 12
            return await src.generate_group()
        finally:
            await src.aclose()

    group = anyio.run(main)
    assert group.scores == [12 * 10000 + 3 * 100 + 40] * 2, group.scores


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([ROWS[0], {"prompt": None, "answer": "1"}], "row 2, column 'prompt': missing"),
        ([ROWS[0], ROWS[1], {"prompt": "  ", "answer": "1"}], "row 3, column 'prompt': empty prompt"),
        ([{"messages": [{"role": "user", "content": "x"}], "answer": "1"}, {"messages": [], "answer": "1"}],
         "row 2, column 'messages': expected a non-empty list"),
        ([{"question": "x", "answer": "1"}], "no prompt column: expected 'prompt'"),
        ([ROWS[0], {"prompt": "2+2=", "answer": None}], "row 2, column 'answer': missing"),
        ([{"prompt": "x" * 300, "answer": "1"}], "row 1, column 'prompt': the prompt is"),
        ([{"prompt": "x", "answer": "1", "completions": "y"}], "column 'completions' clashes"),
    ],
)
def test_a_bad_row_is_an_error_naming_file_row_and_column(tmp_path, tokenizer, rows, expected):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError) as err:
        source(tokenizer, config(path))
    assert str(path) in str(err.value)
    assert expected in str(err.value)


def test_a_bad_row_names_the_line_it_is_on_where_that_is_another_number(tmp_path, tokenizer):
    """An editor goes to lines: a CSV's header, blank lines in JSON Lines and a CSV cell over two
    lines put row N elsewhere than line N, and the error says where."""
    from grpod.rollouts.dataset_files import row_where

    jsonl = tmp_path / "gaps.jsonl"
    jsonl.write_text('{"prompt": "1+1=", "answer": "2"}\n\n\n{"prompt": " ", "answer": "4"}\n')
    with pytest.raises(DatasetError, match=r"gaps.jsonl: row 2 \(line 4\), column 'prompt': empty prompt"):
        source(tokenizer, config(jsonl))
    csv_file = tmp_path / "cells.csv"
    csv_file.write_text('prompt,answer\n"two\nlines",2\n\n1+1=,\n')
    with pytest.raises(DatasetError, match=r"cells.csv: row 2 \(line 5\), column 'answer': missing"):
        source(tokenizer, config(csv_file))
    plain = write_jsonl(tmp_path / "plain.jsonl", [ROWS[0], {"prompt": None, "answer": "1"}])
    assert row_where(plain, 1) == "row 2"
    array = tmp_path / "array.json"
    array.write_text('[\n{"prompt": "1+1=", "answer": "2"},\n{"prompt": "2+2=", "answer": "4"}\n]')
    assert row_where(array, 1) == "row 2" and row_where(tmp_path / "gone.jsonl", 0) == "row 1"


def test_a_prompt_of_the_wrong_type_names_its_row(tmp_path, tokenizer):
    path = tmp_path / "typed.csv"
    path.write_text("prompt,answer\n1+1=,2\n")
    write_jsonl(tmp_path / "typed.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}])
    # A JSONL column that mixes types cannot even be read: the error still names the file.
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": ["x"], "answer": "4"}])
    with pytest.raises(DatasetError, match=str(mixed)):
        source(tokenizer, config(mixed))
    numbers = write_jsonl(tmp_path / "numbers.jsonl", [{"prompt": 12, "answer": "2"}])
    with pytest.raises(DatasetError, match=r"row 1, column 'prompt': expected a string, got int"):
        source(tokenizer, config(numbers))


def test_values_reach_reward_functions_as_the_file_wrote_them(tmp_path):
    """One row written `"answer": 42` made the `datasets` loader fall back to pandas, which re-typed
    the whole column ("72" -> 72, "003" -> 3, "1.50" -> 1.5): a reward comparing strings scored 0 on
    every row and the run trained nothing. CSV cells are text; an empty one is missing."""
    rows = [{"prompt": "1+2=", "answer": "003"}, {"prompt": "2+2=", "answer": "1.50"}, {"prompt": "3+3=", "answer": 42},
            {"prompt": "4+4=", "answer": "72", "note": "x"}]
    mixed = write_jsonl(tmp_path / "mixed.jsonl", rows)
    assert [row["answer"] for row in read_rows(mixed)] == ["003", "1.50", 42, "72"]
    assert [row["note"] for row in read_rows(mixed)] == [None, None, None, "x"], "a key a row lacks is None"
    as_array = tmp_path / "array.json"
    as_array.write_text(json.dumps(rows))
    assert read_rows(as_array) == read_rows(mixed)
    table = tmp_path / "gap.csv"
    table.write_text("prompt,answer\n1+2=,003\n2+2=,\n3+3=,72\n")
    assert [row["answer"] for row in read_rows(table)] == ["003", None, "72"]


def test_check_config_finds_a_prompt_too_long_and_a_held_out_file_the_rewards_cannot_score(tmp_path):
    """Both passed `grpod check-config`: the prompts were tokenized only once the source was built
    (after vLLM had launched), and the start-up call used a training row only, so a held-out file
    without the `answer` column scored every evaluation 0."""
    from grpod.models.tiny import build_model, save_model
    from grpod.rollouts.rewards import RewardLoadError

    save_model(*build_model(seed=0), tmp_path / "model")
    long = write_jsonl(tmp_path / "long.jsonl", [*ROWS[:3], {"prompt": "1+" * 200 + "1=", "answer": "201"}])
    cfg = config(long)
    cfg.model.path = tmp_path / "model"
    with pytest.raises(DatasetError, match=r"long.jsonl: row 4, column 'prompt': the prompt is \d+ tokens"):
        anyio.run(prepare_dataset, cfg)

    module = tmp_path / "needs_answer.py"
    module.write_text("def good(completions, answer, **kw):\n    return [float(c == a) for c, a in zip(completions, answer)]\n")
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "1+1=", "solution": "2"}])
    cfg = config(train, rewards=[{"function": f"{module}:good"}], eval={"dataset": str(held_out), "size": 1})
    cfg.model.path = tmp_path / "model"
    with pytest.raises(RewardLoadError, match=r"eval.jsonl: row 1"):
        anyio.run(prepare_dataset, cfg)


def test_a_reward_raising_on_the_placeholder_is_warned_of_once_naming_the_files_and_rows(tmp_path):
    """It was two identical warnings, "reward function 'raises' raised on the placeholder
    completion: raised IndexError(...)", naming neither the file nor the row (training or held-out)."""
    module = tmp_path / "picky.py"
    module.write_text("def raises(completions, **kw):\n    return [float(c.split()[1]) for c in completions]\n")
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    held_out = write_jsonl(tmp_path / "eval.jsonl", ROWS[:2])
    cfg = config(train, rewards=[{"function": f"{module}:raises"}], eval={"dataset": str(held_out), "size": 1})

    async def prepare():
        prepared = await prepare_dataset(cfg)
        await prepared.scorer.aclose()
        return prepared.warnings

    (warning,) = anyio.run(prepare)
    assert warning.startswith(f"reward function 'raises' ({module}:raises) raised on the placeholder completion '0' ")
    assert f"on {train}: row 1 (training set) and on {held_out}: row 1 (held-out set): " in warning
    assert f"raised IndexError('list index out of range') at {module}:2 in " in warning  # <listcomp> before 3.12


def test_a_missing_training_or_held_out_file_is_named_by_its_key(tmp_path):
    """Both said only "<path>: no such dataset file": which of the two settings was wrong?"""
    from grpod.config import load_config
    from grpod.rollouts.dataset import prepare_dataset

    rows = tmp_path / "train.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    base = ["source.kind='dataset'", "source.dataset.rewards=[{function='exact'}]", f"model.path={str(tmp_path)!r}"]
    for overrides, key in [([f"source.dataset.path={str(tmp_path / 'trian.jsonl')!r}", "eval.size=0"], "source.dataset.path"),
                           ([f"source.dataset.path={str(rows)!r}", f"eval.dataset={str(tmp_path / 'evl.jsonl')!r}"],
                            "eval.dataset")]:
        cfg = load_config(None, base + overrides)
        with pytest.raises(DatasetError, match=f"^{key}: .*no such dataset file"):
            anyio.run(prepare_dataset, cfg)


def test_unknown_suffix_and_missing_file_are_clear(tmp_path):
    with pytest.raises(DatasetError, match="unknown dataset format '.txt'"):
        read_rows(tmp_path / "data.txt")
    with pytest.raises(DatasetError, match="no such dataset file"):
        read_rows(tmp_path / "absent.jsonl")


def _drain_rows(src: DatasetSource, count: int) -> list[int]:
    rows = []
    for _ in range(count):
        epoch, index, item, skipped = src._draw()
        rows.append(item.row)
    return rows


def test_each_epoch_is_a_new_seeded_permutation(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    src = source(tokenizer, config(path, dataset={"shuffle_seed": 7}))
    first, second = _drain_rows(src, 12), _drain_rows(src, 12)
    assert sorted(first) == sorted(second) == list(range(12))
    assert first != second and first != list(range(12))
    assert src.cursor() == {"kind": "dataset", "epoch": 1, "position": 12}
    again = source(tokenizer, config(path, dataset={"shuffle_seed": 7}))
    assert _drain_rows(again, 12) == first
    other = source(tokenizer, config(path, dataset={"shuffle_seed": 8}))
    assert _drain_rows(other, 12) != first


def test_a_resumed_cursor_continues_with_the_same_prompts(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    cfg = config(path, dataset={"shuffle_seed": 3})
    uninterrupted = source(tokenizer, cfg)
    expected = _drain_rows(uninterrupted, 30)
    stopped = source(tokenizer, cfg)
    head = _drain_rows(stopped, 17)
    cursor = json.loads(json.dumps(stopped.cursor()))  # as a checkpoint stores it
    resumed = source(tokenizer, cfg, cursor=cursor)
    assert resumed.peek_rows(13) == expected[17:]
    assert head + _drain_rows(resumed, 13) == expected


class MixedClient(ScriptedClient):
    """Rows 0-5: half the completions right (a group with signal); rows 6-11: all right (none)."""

    async def generate(self, prompt_ids, *, n, **kwargs):
        right = right_answer(self.tokenizer.decode(prompt_ids))
        texts = [right if int(right) >= 12 or i % 2 else "x" for i in range(n)]
        out = []
        for text in texts:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            out.append(Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", text=text))
        return out


def test_active_sampling_rests_rows_without_signal_and_a_resumed_cursor_keeps_them_resting(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)

    def play(cfg, cursor, groups):
        async def main():
            src = await open_source(tokenizer, cfg, cursor=cursor, client_class=MixedClient)
            rows = [int((await src.generate_group()).group_id.split("-")[-1]) for _ in range(groups)]
            return src, rows

        return anyio.run(main)

    rested = config(path, dataset={"shuffle_seed": 5, "rest_epochs": 1})
    src, first = play(rested, None, 12)  # epoch 0: every row; rows 6-11 carried no signal
    assert sorted(first) == list(range(12)) and src.stats.resting == 6
    cursor = json.loads(json.dumps(src.cursor()))  # as a checkpoint stores it
    assert cursor["resting"] == {str(i): 2 for i in range(6, 12)}
    src, second = play(rested, cursor, 18)  # epoch 1: rows 0-5 only; epoch 2: all twelve again
    assert sorted(second[:6]) == list(range(6)) and src.stats.rested == 6
    assert sorted(second[6:]) == list(range(12))
    assert src.cursor()["resting"] == {str(i): 4 for i in range(6, 12)}  # rested again in epoch 3

    plain, rows = play(config(path, dataset={"shuffle_seed": 5}), None, 24)
    assert sorted(rows[12:]) == list(range(12)) and plain.stats.rested == 0 and "resting" not in plain.cursor()


def test_rest_epochs_set_to_zero_while_running_brings_every_resting_row_back(tmp_path, tokenizer):
    """`source.dataset.rest_epochs` is live (`ctl set`, applied at a boundary): turned off, the
    rows resting since the last epoch are drawn again at once, not when their rest would end."""
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    cfg = config(path, dataset={"shuffle_seed": 5, "rest_epochs": 3})

    async def main():
        src = await open_source(tokenizer, cfg, client_class=MixedClient)
        desk = OperatorDesk(cfg, RunProgress(cfg.train.steps))

        async def rows(groups):
            return [int((await src.generate_group()).group_id.split("-")[-1]) for _ in range(groups)]

        first = await rows(12)  # epoch 0: rows 6-11 carry no signal and rest until epoch 4
        resting = src.stats.resting
        await desk.ctl_set({"key": "source.dataset.rest_epochs", "value": 0})
        desk.apply_changes(1, lambda change: None)
        return first, resting, await rows(12), src

    first, resting, second, src = anyio.run(main)
    assert sorted(first) == list(range(12)) and resting == 6
    assert sorted(second) == list(range(12)) and src.stats.resting == 0 and "resting" not in src.cursor()


def test_a_finite_number_of_epochs_exhausts_the_source(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS[:3])
    src = source(tokenizer, config(path, dataset={"epochs": 2}, concurrency=2))
    buffer = RolloutBuffer(100)

    async def main():
        async def may_generate():
            pass

        with anyio.fail_after(20):
            await src.run(buffer, may_generate)  # returns: the source is finite

    anyio.run(main)
    assert len(buffer) == 6 and src.stats.generated == 6
    assert src.stats.exhausted and src.stats.epoch == 2


def test_a_group_is_scored_tagged_and_carries_each_functions_mean(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    cfg = config(path, rewards=[{"function": "exact", "weight": 2.0}, {"function": "regex_format", "pattern": "^1"}])

    async def main():
        src = await open_source(tokenizer, cfg, answer_for=lambda text: "14")
        try:
            return src, [await src.generate_group() for _ in range(12)]
        finally:
            await src.aclose()

    src, groups = anyio.run(main)
    by_row = {int(g.group_id.split("-")[-1]): g for g in groups}
    assert by_row[7].scores == [2.0 + 1.0, 2.0 + 1.0]  # 7+7 = 14 and starts with 1
    assert by_row[3].scores == [1.0, 1.0]  # wrong answer, right format
    assert by_row[7].extra["reward_means"] == {"exact": 1.0, "regex_format": 1.0}
    group = by_row[7]
    assert group.policy_version == 3 and group.source == "dataset"
    prompt = src.items[7].prompt_ids
    assert group.tokens[0][: len(prompt)] == prompt
    assert group.loss_mask[0] == [0] * len(prompt) + [1] * (len(group.tokens[0]) - len(prompt))


def generate_groups(tokenizer, cfg, n: int) -> tuple[DatasetSource, list]:
    """`n` groups of a source with pooled reward functions, in one event loop (its workers'), closed after."""

    async def main():
        src = await open_source(tokenizer, cfg)
        try:
            with anyio.fail_after(60):
                return src, [await src.generate_group() for _ in range(n)]
        finally:
            await src.aclose()

    return anyio.run(main)


def test_reward_failures_drop_the_group_with_their_reason_and_the_source_goes_on(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    module = tmp_path / "flaky.py"
    module.write_text(
        "import math, os, time\n"
        "def flaky(prompts, completions, completion_ids, answer, **kw):\n"
        "    if answer[0] == '4':\n"
        "        raise ValueError('no fours')\n"
        "    if answer[0] == '6':\n"
        "        return [math.nan] * len(completions)\n"
        "    if answer[0] == '8':\n"
        "        return [1.0]\n"
        "    if answer[0] == '10':\n"
        "        return ['high', 'low']\n"
        "    if answer[0] == '12':\n"
        "        time.sleep(60)\n"
        "    if answer[0] == '14':\n"
        "        os._exit(3)\n"
        "    return [1.0] * len(completions)\n"
    )
    cfg = config(path, dataset={"reward_timeout_s": 1.0, "reward_workers": 2}, rewards=[{"function": f"{module}:flaky"}])

    src, groups = generate_groups(tokenizer, cfg, 12)
    assert sum(g is None for g in groups) == 6
    assert src.stats.generated == 6 and src.stats.dropped == 6
    assert src.stats.drop_reasons == {"reward_error": 1, "reward_nan": 1, "reward_bad_length": 1,
                                      "reward_bad_type": 1, "reward_timeout": 1, "reward_crash": 1}
    assert all(g.scores == [1.0, 1.0] for g in groups if g is not None)


def test_what_a_crashed_reward_worker_started_dies_with_it(tmp_path, tokenizer):
    """A reward that starts a process and then crashes its worker (os._exit) left that process
    running, one per crash: the worker's group was signalled only while the worker was unreaped."""
    import psutil

    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    pids = tmp_path / "pids"
    module = tmp_path / "forking.py"
    module.write_text(
        "import os, subprocess\n"
        "def forking(completions, answer, **kw):\n"
        f"    if not os.path.exists({str(pids)!r}):\n"  # the start-up probe, the first call
        f"        open({str(pids)!r}, 'w').close()\n"
        "        return [0.0] * len(completions)\n"
        "    child = subprocess.Popen(['sleep', '300'])\n"
        f"    with open({str(pids)!r}, 'a') as f:\n"
        "        f.write(f'{child.pid}\\n')\n"
        "    os._exit(3)\n"
    )
    cfg = config(path, dataset={"reward_workers": 1}, rewards=[{"function": f"{module}:forking"}])

    src, groups = generate_groups(tokenizer, cfg, 2)
    started = [int(line) for line in pids.read_text().split()]
    assert groups == [None, None] and src.stats.drop_reasons == {"reward_crash": 2} and len(started) == 2
    left = [pid for pid in started if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert left == [], f"processes a crashed worker started are still running: {left}"


def test_a_reward_that_answers_none_for_everything_is_a_run_of_failures(tmp_path, tokenizer):
    """Its groups were dropped as `reward_unscorable` without counting as failures: no source
    alarm, no source.fail_after_s, and a run of train.steps that never ended."""
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    module = tmp_path / "silent.py"
    module.write_text("def silent(completions, **kw):\n    return [None] * len(completions)\n")
    cfg = config(path, dataset={"reward_workers": 1}, rewards=[{"function": f"{module}:silent"}])

    src, groups = generate_groups(tokenizer, cfg, 3)
    assert groups == [None] * 3 and src.stats.drop_reasons == {"reward_unscorable": 3}
    assert src.stats.consecutive_errors == 3 and src.stats.failing_since is not None
    assert "returned None for every completion" in src.stats.last_error


def test_evaluation_gives_pass_at_1_and_mean_at_k(tmp_path, tokenizer):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(20, 30)])
    cfg = config(train, temperature=0.7, max_tokens=6, eval={"dataset": str(held_out), "size": 8, "k": 3})
    # Correct on even operands only.
    src = source(tokenizer, cfg, answer_for=lambda text: right_answer(text) if int(right_answer(text)) % 4 == 0 else "0")
    result = anyio.run(src.evaluate, 8, 4)
    assert result["eval_size"] == 8 and result["eval_k"] == 3
    assert result["eval_accuracy"] == 0.5 and result["eval_mean_at_k"] == 0.5
    # Greedy once per row, then k samples at the source's temperature, with the source's budget.
    temperatures = sorted({(r["n"], r["temperature"], r["max_tokens"]) for r in _client(src).requests})
    assert temperatures == [(1, 0.0, 6), (3, 0.7, 6)]


def test_a_held_out_row_whose_request_fails_is_left_out_and_the_evaluation_goes_on(tmp_path, tokenizer):
    """A request of one held-out row that times out (vLLM under load) costs that row, not the
    evaluation: the record counts it apart and the accuracy is over the rows scored."""
    from grpod.inference.client import InferenceRequestError
    from grpod.rollouts.held_out import EvaluationFailed

    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(20, 30)])
    cfg = config(train, max_tokens=6, eval={"dataset": str(held_out), "size": 8})

    def answer(text: str) -> str:
        operand = int(right_answer(text)) // 2
        if operand == 23:
            raise InferenceRequestError("/v1/completions", None, "no response: timed out after 120 s")
        return right_answer(text) if operand % 2 == 0 else "0"

    result = anyio.run(source(tokenizer, cfg, answer_for=answer).evaluate, 8, 4)
    assert result["eval_failed"] == 1 and result["eval_size"] == 7
    assert result["eval_accuracy"] == 4 / 7, "20, 22, 24, 26 right; 21, 25, 27 wrong; 23 left out"

    def down(text: str) -> str:
        raise InferenceRequestError("/v1/completions", None, "connection refused")

    with pytest.raises(EvaluationFailed, match=r"every one of the 8 held-out rows failed; the first: eval row \d+: "
                                               r"InferenceRequestError: .*connection refused"):
        anyio.run(source(tokenizer, cfg, answer_for=down).evaluate, 8, 4)


def _client(src: DatasetSource) -> ScriptedClient:
    return src.client


def test_config_names_the_missing_keys(tmp_path):
    with pytest.raises(ConfigError, match="source.dataset.path"):
        parse_config({"source": {"kind": "dataset"}})
    with pytest.raises(ConfigError, match=r"\[\[source.dataset.rewards\]\]"):
        parse_config({"source": {"kind": "dataset", "dataset": {"path": "x.jsonl"}}})
    with pytest.raises(ConfigError, match="eval.dataset"):
        config(tmp_path / "x.jsonl", eval={"size": 4})


EXAMPLE = Path(__file__).resolve().parents[2] / "etc" / "examples"


def test_the_shipped_example_task_is_reproducible_loads_and_scores(tmp_path, tokenizer):
    import subprocess
    import sys

    from grpod.config import load_config

    subprocess.run([sys.executable, str(EXAMPLE / "arith-word" / "make_data.py"), str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLE / "arith-word" / name).read_bytes(), name
    train = {json.loads(line)["prompt"] for line in (tmp_path / "train.jsonl").read_text().splitlines()}
    held_out = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert len(train) == 2000 and len(held_out) == 100 and not train & {row["prompt"] for row in held_out}

    cfg = load_config(EXAMPLE / "smollm2-dataset.toml")
    # The paths in the example are relative to the repository root; the tiny tokenizer stands in
    # for SmolLM2's (the model is not built in unit tests).
    cfg.source.dataset.path = EXAMPLE / "arith-word" / "train.jsonl"
    cfg.eval.dataset = EXAMPLE / "arith-word" / "eval.jsonl"
    cfg.source.dataset.rewards[0].function = f"{EXAMPLE / 'arith-word' / 'rewards.py'}:correct"
    answer = held_out[0]["answer"]

    async def main():
        src = await open_source(tokenizer, cfg, answer_for=lambda text: f"So the answer is {answer}.")
        try:
            return src, await src.evaluate(1, 8)
        finally:
            await src.aclose()

    src, result = anyio.run(main)
    assert len(src.items) == 2000 and len(src.eval_items) == 100
    assert result["eval_accuracy"] == 1.0 and result["eval_mean_at_k"] == 1.0
