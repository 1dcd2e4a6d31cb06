"""Held-out rows played one by one: a failed row is counted and named, never the whole evaluation;
the first real error of a task group's exception groups (`grpod.errors.first_error`)."""

from __future__ import annotations

import asyncio

import anyio
import pytest
from structlog.testing import capture_logs

from grpod.daemon.evaluation import Evaluations
from grpod.daemon.progress import RunProgress
from grpod.errors import first_error
from grpod.rollouts.held_out import EvaluationFailed, play_rows


def test_first_error_finds_the_first_leaf_of_the_kind_and_passes_over_cancellation():
    boom, late = ValueError("boom"), KeyError("late")
    nested = BaseExceptionGroup("outer", [asyncio.CancelledError(), ExceptionGroup("inner", [boom, late])])
    assert first_error(nested) is boom
    assert first_error(nested, KeyError) is late
    assert first_error(boom) is boom
    assert first_error(BaseExceptionGroup("cancelled", [asyncio.CancelledError()])) is None
    assert first_error(KeyboardInterrupt()) is None


def test_a_failed_row_is_counted_and_named_and_the_others_are_played():
    played: list[int] = []

    async def play(row: int) -> None:
        await anyio.sleep(0.01 * (row % 3))
        if row == 4:
            raise ExceptionGroup("a task group", [TimeoutError("no response after 120 s")])
        played.append(row)

    with capture_logs() as logs:
        failed = anyio.run(lambda: play_rows(range(8), play, concurrency=3, where=lambda row: f"eval row {row}"))
    assert failed == 1 and sorted(played) == [0, 1, 2, 3, 5, 6, 7]
    [warning] = [entry for entry in logs if entry["event"] == "eval_row_failed"]
    assert warning["row"] == "eval row 4" and "TimeoutError: no response after 120 s" in warning["error"]


def test_an_evaluation_whose_every_row_failed_fails_saying_the_first_error():
    async def play(row: int) -> None:
        raise ConnectionError(f"engine gone (row {row})")

    with pytest.raises(EvaluationFailed, match=r"every one of the 3 held-out rows failed; the first: row \d: ConnectionError"):
        anyio.run(lambda: play_rows(range(3), play, concurrency=2, where=lambda row: f"row {row}"))
    assert anyio.run(lambda: play_rows([], play, concurrency=2, where=str)) == 0


class _FailingSource:
    async def evaluate(self, size: int, max_tokens: int) -> dict:
        async with anyio.create_task_group() as tg:
            async def fail() -> None:
                raise ValueError("a reward function's module is gone")

            tg.start_soon(fail)
        return {}


def test_a_failed_evaluation_is_logged_with_what_failed_inside_its_task_group():
    from grpod.config import EvalConfig

    class Reporter:
        def eval_done(self, *args, **kwargs):
            raise AssertionError("a failed evaluation has no record")

    evaluations = Evaluations(EvalConfig(size=4), source=_FailingSource(), reporter=Reporter(),
                              progress=RunProgress(steps=1), beside_training=False)
    with capture_logs() as logs:
        anyio.run(evaluations.run, "periodic", None)
    [failed] = [entry for entry in logs if entry["event"] == "eval_failed"]
    assert failed["error"] == "ValueError: a reward function's module is gone", failed
    assert evaluations.describe() is None


def test_an_evaluation_of_the_version_just_evaluated_records_that_result_again():
    """A stop during a periodic evaluation waits for it, then asks for the run's last one: of the
    same weights, it is that result again (`reused`), not a second decode."""
    from grpod.config import EvalConfig
    from grpod.daemon.evaluation import Evaluations
    from grpod.daemon.progress import RunProgress

    progress = RunProgress(steps=10)
    decoded = []

    class Source:
        async def evaluate(self, size, max_tokens):
            decoded.append(size)
            return {"eval_accuracy": 0.25, "eval_size": size, "policy_version": 8 + len(decoded) - 1}

    class Reporter:
        records = []

        def eval_done(self, result, when, *, step):
            progress.last_eval = {**result, "when": when, "step": step, "finished_step": progress.step}
            self.records.append(progress.last_eval)

    evaluations = Evaluations(EvalConfig(size=4), source=Source(), reporter=Reporter(), progress=progress,
                              beside_training=False)
    progress.step = 6
    anyio.run(lambda: evaluations.run("periodic", None, version=7))
    progress.step = 7
    anyio.run(lambda: evaluations.run("end", None, version=8))
    assert decoded == [4] and Reporter.records[-1]["when"] == "end" and Reporter.records[-1]["reused"] == "periodic"
    assert Reporter.records[-1]["step"] == 6 and Reporter.records[-1]["eval_accuracy"] == 0.25
    anyio.run(lambda: evaluations.run("end", None, version=9))  # new weights: decoded
    assert decoded == [4, 4] and "reused" not in Reporter.records[-1]


def test_a_source_without_a_held_out_set_says_so_once_instead_of_evaluating_nothing_in_silence():
    """Atropos and replay sources have no held-out set: eval.size did nothing, and nothing said so."""
    from grpod.config import EvalConfig
    from grpod.rollouts.replay import ReplaySource

    class Reporter:
        def eval_done(self, *args, **kwargs):
            raise AssertionError("nothing was evaluated")

    source = ReplaySource.__new__(ReplaySource)  # its evaluate() reads nothing of the instance
    evaluations = Evaluations(EvalConfig(size=4), source=source, reporter=Reporter(), progress=RunProgress(steps=1),
                              beside_training=False)
    with capture_logs() as logs:
        anyio.run(evaluations.run, "start", None)
        anyio.run(evaluations.run, "periodic", None)
    [said] = [entry for entry in logs if entry["event"] == "eval_unavailable"]
    assert said["source"] == "ReplaySource" and "eval.size = 4 evaluates nothing" in said["why"]
