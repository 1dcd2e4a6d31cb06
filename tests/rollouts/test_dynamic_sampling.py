"""DAPO's dynamic sampling: zero-variance groups are not queued; a saturated task cannot stall."""

import anyio

from grpod.config import parse_config
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.dynamic_sampling import DynamicSampling as _DynamicSampling
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.sampling_source import SamplingStats as SourceStats
from grpod.rollouts.kinds import make_source
from grpod.rollouts.validation import RejectionCounter


def DynamicSampling(cfg):  # noqa: N802 — the filter as the source factory builds it from `cfg`
    src = cfg.source
    return _DynamicSampling(src.dynamic_sampling, src.dynamic_sampling_max_filtered, cfg.train.advantages, cfg.completion_budget)


def group(scores, gid="g"):
    n = len(scores)
    return RolloutGroup(tokens=[[1, 2, 3]] * n, loss_mask=[[0, 1, 1]] * n, scores=list(scores), group_id=gid)


def test_off_by_default_admits_everything():
    sampling = DynamicSampling(parse_config({}))
    stats = SourceStats()
    assert sampling.admit(group([1.0, 1.0]), stats) and stats.dynamic_filtered == 0


def test_zero_variance_groups_are_filtered_and_counted():
    sampling = DynamicSampling(parse_config({"source": {"dynamic_sampling": True}}))
    stats = SourceStats()
    assert not sampling.admit(group([1.0, 1.0]), stats)
    assert sampling.admit(group([1.0, 0.0]), stats)
    assert not sampling.admit(group([0.0, 0.0]), stats)
    assert stats.dynamic_filtered == 2 and stats.dynamic_let_through == 0


def test_overlong_shaping_counts_as_signal_like_the_trainer_sees_it():
    cfg = parse_config({"source": {"dynamic_sampling": True, "max_tokens": 4}, "train": {"advantages": {"overlong_buffer": 2}}})
    long_and_short = RolloutGroup(tokens=[[1] * 6, [1] * 3], loss_mask=[[0, 0, 1, 1, 1, 1], [0, 1, 1]], scores=[1.0, 1.0])
    assert DynamicSampling(cfg).admit(long_and_short, SourceStats())


def test_a_saturated_task_lets_one_through_after_the_bound():
    sampling = DynamicSampling(parse_config({"source": {"dynamic_sampling": True, "dynamic_sampling_max_filtered": 3}}))
    stats = SourceStats()
    admitted = [sampling.admit(group([1.0, 1.0]), stats) for _ in range(8)]
    assert admitted == [False, False, False, True, False, False, False, True]
    assert stats.dynamic_filtered == 6 and stats.dynamic_let_through == 2


def test_the_builtin_source_queues_only_groups_with_signal(monkeypatch):
    cfg = parse_config({"source": {"dynamic_sampling": True}})
    source = make_source(cfg, None, None, None, RejectionCounter())
    produced = iter([group([1.0, 1.0], "flat-1"), group([0.0, 1.0], "signal-1"), group([0.0, 0.0], "flat-2"),
                     group([1.0, 0.0], "signal-2")])

    async def fake_generate():
        return next(produced)

    monkeypatch.setattr(source, "generate_group", fake_generate)
    buffer = RolloutBuffer(8)

    async def fill_until_two():
        while len(buffer) < 2:
            await source.fill(buffer, 2 - len(buffer))

    anyio.run(fill_until_two)
    assert [g.group_id for g in buffer.snapshot()] == ["signal-1", "signal-2"]
    assert source.stats.dynamic_filtered == 2
