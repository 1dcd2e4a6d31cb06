"""The step loop's path without vLLM, with the real trainer: validation and the staleness bound
before the loss.

The bridge is a stand-in (a policy version and a counting sync): what is under test is which
groups reach the trainer, and what the metrics and `ctl status` say about the others.
"""

import json
import random

import anyio
import pytest

from grpod.config import load_config
from grpod.models.tiny import build_model, save_model
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.sampling_source import SamplingStats
from grpod.training.trainer import build_trainer
from tests.daemon.conftest import StandInBridge, make_loop


def _group(gid, version, rng):
    prompt = [1, 53, 25, 10, 4, 11, 2, 25, 1, 54, 25]
    tokens, masks, logprobs = [], [], []
    for _ in range(4):
        completion = [rng.randrange(3, 20) for _ in range(3)] + [2]
        tokens.append(prompt + completion)
        masks.append([0] * len(prompt) + [1] * len(completion))
        logprobs.append([0.0] * len(prompt) + [-rng.uniform(0.1, 3.0) for _ in completion])
    return RolloutGroup(tokens, masks, [0.0, 1.0, 0.0, 1.0], logprobs, policy_version=version, group_id=gid)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-path-model")
    model, tok = build_model(seed=0)
    save_model(model, tok, root)
    return root


@pytest.fixture()
def daemon(tmp_path, model_dir):
    cfg = load_config(None, [f"run.dir={str(tmp_path / 'run')!r}", f"model.path={str(model_dir)!r}",
                             "train.max_staleness=2", "run.progress=false"])
    trainer = build_trainer(cfg)
    loop = make_loop(cfg, trainer, bridge=StandInBridge(10, sync_every=1000), vocab_size=trainer.vocab_size)
    loop.status = loop.reporter.status
    loop.metrics = loop.reporter.metrics
    return loop


def _trained_ids(daemon, monkeypatch):
    seen = []
    real = daemon.trainer.plan

    def spy(groups):
        if groups:  # an empty batch is planned too (a skip: its lr schedule step), training nothing
            seen.append([g.group_id for g in groups])
        return real(groups)

    monkeypatch.setattr(daemon.trainer, "plan", spy)
    return seen


def test_stale_groups_never_reach_the_loss(daemon, monkeypatch):
    rng = random.Random(0)
    seen = _trained_ids(daemon, monkeypatch)
    groups = [_group("fresh", 10, rng), _group("edge", 8, rng), _group("stale", 7, rng), _group("ancient", 1, rng)]
    anyio.run(daemon.step, groups)
    assert seen == [["fresh", "edge"]]
    status = daemon.status()
    assert status["staleness"]["dropped"] == 2
    assert status["staleness"]["histogram"] == {"0": 1, "2": 1, "3": 1, "9": 1}
    record = daemon.metrics.read()[-1]
    assert record["staleness_max"] == 9 and record["group_ids"] == ["fresh", "edge"]


def test_downweight_policy_trains_them_with_smaller_weight(daemon, monkeypatch):
    daemon.cfg.train.stale_policy = "downweight"
    rng = random.Random(1)
    weights = []
    real = daemon.trainer.plan
    monkeypatch.setattr(daemon.trainer, "plan", lambda gs: weights.append([g.weight for g in gs]) or real(gs))
    anyio.run(daemon.step, [_group("fresh", 10, rng), _group("stale", 6, rng)])
    assert weights == [[1.0, pytest.approx(1 / 3)]]
    assert daemon.status()["staleness"]["downweighted"] == 1


def test_malformed_groups_are_rejected_and_the_rest_trains(daemon, monkeypatch):
    rng = random.Random(2)
    seen = _trained_ids(daemon, monkeypatch)
    good = _group("good", 10, rng)
    short = _group("short-mask", 10, rng)
    short.loss_mask[1] = short.loss_mask[1][:-1]
    outside = _group("out-of-vocab", 10, rng)
    outside.tokens[0][-2] = 10_000
    anyio.run(daemon.step, [good, short, outside])
    assert seen == [["good"]]
    assert sum(daemon.status()["rejected"].values()) == 2


def test_a_batch_with_nothing_valid_is_skipped_not_fatal(daemon, monkeypatch):
    rng = random.Random(3)
    seen = _trained_ids(daemon, monkeypatch)
    bad = _group("bad", 10, rng)
    bad.scores = [float("nan")] * 4
    epoch = daemon.trainer.scheduler.last_epoch
    anyio.run(daemon.step, [bad])
    assert seen == []
    assert daemon.progress.step == 1 and daemon.metrics.read()[-1]["skipped"] == 1
    # The lr schedule counts batches, skipped ones too (it fell one behind train.steps per such batch).
    assert daemon.trainer.scheduler.last_epoch == epoch + 1
    status = daemon.status()
    assert (status["trained_steps"], status["skipped_batches"]) == (0, 1)


def test_a_run_that_trained_nothing_says_so_and_fails(daemon):
    # Issue: a run fed only rejected groups ended "steps done" with exit 0.
    rng = random.Random(6)
    daemon.cfg.train.steps, daemon.cfg.train.groups_per_step = 2, 1
    bad = [_group(f"bad-{i}", 10, rng) for i in range(2)]
    for g in bad:
        g.scores = [float("nan")] * 4
    daemon.buffer.restore(bad)
    anyio.run(daemon.run)
    assert daemon.progress.step == 2 and daemon.progress.exit_code == 1
    assert daemon.progress.stop_reason.startswith("no step trained: all 2 batches were skipped")


def test_a_run_with_some_trained_steps_ends_normally(daemon):
    rng = random.Random(7)
    daemon.cfg.train.steps, daemon.cfg.train.groups_per_step = 2, 1
    bad = _group("bad", 10, rng)
    bad.scores = [float("nan")] * 4
    daemon.buffer.restore([bad, _group("good", 10, rng)])
    anyio.run(daemon.run)
    assert daemon.progress.exit_code == 0 and daemon.progress.stop_reason == "steps done"
    assert (daemon.progress.trained_steps, daemon.progress.skipped_batches) == (1, 1)


def test_groups_without_inference_logprobs_train_uncorrected(daemon, monkeypatch):
    # F6: such groups (Atropos sends `inference_logprobs: null`) were all rejected while the run
    # counted the step; now they train with IS weight 1 and the metrics say how many tokens.
    rng = random.Random(4)
    seen = _trained_ids(daemon, monkeypatch)
    group = _group("no-logprobs", 10, rng)
    group.inference_logprobs = None
    anyio.run(daemon.step, [group])
    assert seen == [["no-logprobs"]]
    record = daemon.metrics.read()[-1]
    assert record["skipped"] == 0.0 and record["is_uncorrected_tokens"] == 16.0
    assert daemon.status()["rejected"] == {}


def test_a_null_temperature_override_trains_at_the_groups_temperature(daemon, monkeypatch):
    # F2: `{"temperature": null}` passed validation, then float(None) ended the run in train_step.
    rng = random.Random(5)
    seen = _trained_ids(daemon, monkeypatch)
    group = _group("null-override", 10, rng)
    group.overrides = [{"temperature": None}, {}, {"temperature": None}, {}]
    bad = _group("string-override", 10, rng)
    bad.overrides = [{"temperature": "hot"}, {}, {}, {}]
    anyio.run(daemon.step, [group, bad])
    assert seen == [["null-override"]]
    assert daemon.status()["rejected"] == {"bad_temperature": 1}
    assert daemon.metrics.read()[-1]["skipped"] == 0.0


def test_a_group_that_arrives_twice_is_trained_once(daemon, monkeypatch):
    rng = random.Random(8)
    seen = _trained_ids(daemon, monkeypatch)
    group = _group("first", 10, rng)
    again = RolloutGroup(group.tokens, group.loss_mask, group.scores, group.inference_logprobs, policy_version=10,
                         group_id="second-id")
    anyio.run(daemon.step, [group])
    anyio.run(daemon.step, [again, _group("other", 10, rng)])
    assert seen == [["first"], ["other"]]
    assert daemon.status()["rejected"] == {"duplicate": 1}


def test_two_alike_groups_of_a_source_that_samples_its_own_are_both_trained(daemon, monkeypatch):
    """A dataset row drawn again in a later epoch, answered with the same short completions: a
    fresh draw with a learning signal, rejected as `duplicate` by a window meant for sources that
    resend (Atropos). A source that samples its own groups has no window."""
    from grpod.rollouts.admission import BatchAdmission
    from grpod.rollouts.dataset import DatasetSource

    assert DatasetSource.may_resend is False
    admission = BatchAdmission(daemon.cfg.train, vocab_size=daemon.admission.vocab_size, max_seq_len=64,
                               rejections=daemon.admission.rejections, may_resend=DatasetSource.may_resend)
    rng = random.Random(11)
    group = _group("dataset-0-3", 10, rng)
    again = RolloutGroup(group.tokens, group.loss_mask, group.scores, group.inference_logprobs, policy_version=10,
                         group_id="dataset-1-3")
    assert [g.group_id for g in admission.admit([group], 10).groups] == ["dataset-0-3"]
    assert [g.group_id for g in admission.admit([again], 10).groups] == ["dataset-1-3"]


def test_rollouts_jsonl_records_only_trained_groups(daemon, monkeypatch):
    rng = random.Random(9)
    daemon.cfg.run.record_rollouts = True
    daemon.run_dir.mkdir(parents=True, exist_ok=True)
    bad = _group("bad", 10, rng)
    bad.scores = [float("nan")] * 4
    stale = _group("stale", 1, rng)
    anyio.run(daemon.step, [_group("good", 10, rng), bad, stale])
    lines = (daemon.run_dir / "rollouts.jsonl").read_text().splitlines()
    assert [json.loads(line)["group"]["group_id"] for line in lines] == ["good"]


def test_each_reward_functions_mean_reaches_metrics_and_status(daemon):
    rng = random.Random(10)
    daemon.run_dir.mkdir(parents=True, exist_ok=True)
    first, second = _group("a", 10, rng), _group("b", 10, rng)
    first.extra = {"reward_means": {"correct": 0.5, "format": 1.0}}
    second.extra = {"reward_means": {"correct": 0.25}}
    anyio.run(daemon.step, [first, second])
    daemon.metrics.close()
    (record,) = daemon.metrics.read()
    assert record["reward/correct"] == 0.375 and record["reward/format"] == 1.0
    assert daemon.status()["last_metrics"]["reward/correct"] == 0.375


def test_step_records_carry_the_sources_sampled_token_count_when_it_keeps_one(daemon):
    """`sampled_tokens`: what the engines sampled for training so far, trained or not, and
    `dynamic_filtered`: the groups dynamic sampling threw away so far (a sampling source's
    counters); a source without them (Atropos, replay) adds nothing."""
    rng = random.Random(11)
    daemon.run_dir.mkdir(parents=True, exist_ok=True)
    anyio.run(daemon.step, [_group("a", 10, rng)])
    daemon.source.stats = SamplingStats(sampled_tokens=1234, dynamic_filtered=7)
    anyio.run(daemon.step, [_group("b", 10, rng)])
    daemon.metrics.close()
    first, second = daemon.metrics.read()
    assert "sampled_tokens" not in first and "dynamic_filtered" not in first
    assert second["sampled_tokens"] == 1234 and second["dynamic_filtered"] == 7


def test_gradient_tokens_count_the_completion_tokens_trained_with_a_non_zero_advantage(daemon):
    """`gradient_tokens`: a group whose scores are all equal trains nothing (advantage 0), so its
    tokens are not counted; `gradient_token_share`: the run's gradient tokens over every completion
    token the source sampled."""
    rng = random.Random(12)
    daemon.run_dir.mkdir(parents=True, exist_ok=True)
    flat = _group("flat", 10, rng)
    flat.scores = [1.0] * 4
    daemon.source.stats = SamplingStats(sampled_tokens=40)
    anyio.run(daemon.step, [_group("signal", 10, rng), flat])
    daemon.source.stats = SamplingStats(sampled_tokens=64)
    anyio.run(daemon.step, [_group("again", 10, rng)])
    daemon.metrics.close()
    first, second = daemon.metrics.read()
    assert first["gradient_tokens"] == 16 and first["gradient_token_share"] == 16 / 40
    assert second["gradient_tokens"] == 16 and second["gradient_token_share"] == 32 / 64


def test_the_last_checkpoint_knows_whether_it_still_holds_the_run(daemon):
    """The stop's checkpoint is skipped only when the last one holds the run as it is: a `ctl set`
    or a `ctl sync` after a `ctl checkpoint` changes what a checkpoint would hold (a stop after
    them wrote nothing, and the restart lost the set value and the version)."""
    rng = random.Random(12)
    anyio.run(daemon.step, [_group("a", 10, rng)])
    anyio.run(daemon.checkpoint)
    assert daemon.progress.last_checkpoint["state"] == daemon.checkpoint_state()
    anyio.run(daemon.desk.ctl_set, {"key": "train.lr", "value": 5e-4})
    assert daemon.progress.last_checkpoint["state"] != daemon.checkpoint_state()
    anyio.run(daemon.checkpoint)
    assert daemon.progress.last_checkpoint["state"] == daemon.checkpoint_state()
    anyio.run(lambda: daemon.bridge.sync_now(forced=True))
    assert daemon.progress.last_checkpoint["state"] != daemon.checkpoint_state()
    json.dumps(daemon.status()["last_checkpoint"])  # what `ctl status` sends
