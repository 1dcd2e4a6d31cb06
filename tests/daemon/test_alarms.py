"""The trainer/vLLM logprob-gap alarm: staleness noise stays quiet, a persistent bias raises it."""

import random

from grpod.daemon.alarms import LogprobGapAlarm


def test_staleness_noise_does_not_raise_it():
    rng = random.Random(0)
    alarm = LogprobGapAlarm(0.05)
    for step in range(100):  # like the embedded default: mean -0.005, single steps up to |0.044|
        alarm.observe(step, {"logprob_diff_mean": rng.gauss(-0.005, 0.015)})
    assert not alarm.active and alarm.raised == 0


def test_a_broken_sampling_contract_raises_it_once_and_it_clears(capsys):
    alarm = LogprobGapAlarm(0.05, window=5)
    for step in range(8):  # SmolLM2 under its generation_config defaults: -0.175 nats/token
        alarm.observe(step, {"logprob_diff_mean": -0.175})
    assert alarm.active and alarm.since_step == 4 and alarm.raised == 1
    assert "ALARM at step 4" in capsys.readouterr().err
    for step in range(8, 14):
        alarm.observe(step, {"logprob_diff_mean": 0.0})
    assert not alarm.active and alarm.describe()["mean_gap"] == 0.0
    alarm.observe(14, {"logprob_diff_mean": float("nan")})
    assert alarm.describe()["window_steps"] == 5
