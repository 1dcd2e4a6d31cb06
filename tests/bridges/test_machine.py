import pytest

from grpod.bridges import none
from grpod.bridges.machine import IllegalTransition, StateMachine, render_table


def _machine():
    return StateMachine("none", none.TABLE, none.State.IDLE)


def test_happy_path_and_history():
    m = _machine()
    for event in ("START", "READY", "PROBE_OK", "SYNC", "SAVED", "APPLIED", "PROBE_OK"):
        m.fire(none.Event[event])
    assert m.state is none.State.SERVING
    assert [t.event for t in m.history][-3:] == ["SAVED", "APPLIED", "PROBE_OK"]
    assert all(t.elapsed_s >= 0 for t in m.history)


def test_illegal_transition_is_refused():
    m = _machine()
    with pytest.raises(IllegalTransition, match="SYNC is not allowed in state IDLE"):
        m.fire(none.Event.SYNC)
    assert m.state is none.State.IDLE


def test_probe_failure_lands_in_failed_and_sync_retries():
    m = _machine()
    m.fire(none.Event.START)
    m.fire(none.Event.READY)
    m.fire(none.Event.PROBE_FAIL, error="mismatch")
    assert m.state is none.State.FAILED and m.error == "mismatch"
    m.fire(none.Event.SYNC)
    assert m.state is none.State.SAVING


def test_every_state_can_stop_and_the_docstring_shows_the_table():
    for state in none.State:
        if state not in (none.State.STOPPING, none.State.STOPPED):
            assert none.TABLE[(state, none.Event.STOP)] is none.State.STOPPING
    rendered = render_table(none.TABLE)
    assert "SERVING" in rendered and "--SYNC" in rendered
    for row in ("SAVING      --SAVED------>  APPLYING", "APPLYING    --APPLIED---->  PROBING"):
        assert row in none.__doc__


def test_probe_tolerance_knows_the_serving_dtype():
    from grpod.bridges.probe import ProbeResult, ProbeTolerance
    from grpod.config import NoneBridgeConfig

    cfg = NoneBridgeConfig()
    fp32 = ProbeTolerance.for_serving("float32", cfg)
    bf16 = ProbeTolerance.for_serving("bfloat16", cfg)
    # bf16 rounding of the same weights as measured (tiny model): max 0.18, mean 0.028, p95 0.10
    rounding = dict(max_abs_diff=0.181, mean_abs_diff=0.028, tokens=65, p95_abs_diff=0.104)
    assert not ProbeResult(tolerance=fp32, **rounding).ok
    assert ProbeResult(tolerance=bf16, **rounding).ok
    # one missed step under bf16: mean 0.168, p95 0.60
    assert not ProbeResult(tolerance=bf16, max_abs_diff=0.85, mean_abs_diff=0.168, tokens=65, p95_abs_diff=0.6).ok
    assert fp32.describe() == "max <= 0.02" and bf16.describe() == "mean <= 0.07, p95 <= 0.3"
