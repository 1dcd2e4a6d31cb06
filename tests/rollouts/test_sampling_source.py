"""The generation path the builtin and dataset sources share (`SamplingSource`), through the
builtin source with a scripted client standing in for vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import anyio

from grpod.config import parse_config
from grpod.inference.client import Completion
from grpod.models.tiny import build_tokenizer
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.kinds import make_source
from grpod.rollouts.validation import RejectionCounter
from tests.rollouts.conftest import scripted_policy


def _builtin(generate, version=5):
    cfg = parse_config({"source": {"group_size": 3, "max_tokens": 5, "temperature": 0.9}})
    tokenizer = build_tokenizer()
    policy, engine = scripted_policy(SimpleNamespace(generate=generate), version=version, served_name="policy-v4")
    source = make_source(cfg, tokenizer, policy, None, RejectionCounter())
    source.engine = engine
    return source, tokenizer


def test_a_group_is_one_request_scored_and_tagged_with_the_older_version():
    requests = []

    async def generate(prompt, **kwargs):
        requests.append(kwargs)
        source.engine.version = 4  # the engine's weights changed while the request ran
        return [Completion(token_ids=[7, 8], logprobs=[-0.1, -0.2], finish_reason=reason, text="x")
                for reason in ("stop", "length", "stop")]

    source, _ = _builtin(generate, version=5)
    group = anyio.run(source.generate_group)
    assert requests == [{"n": 3, "max_tokens": 5, "temperature": 0.9, "top_p": 1.0, "model": "policy-v4"}]
    prompt_len = len(group.tokens[0]) - 2
    assert group.loss_mask[0] == [0] * prompt_len + [1, 1]
    assert group.inference_logprobs[1][-2:] == [-0.1, -0.2] and group.truncated == [False, True, False]
    assert group.policy_version == 4 and group.group_id == "builtin-0" and group.temperature == 0.9
    assert group.scores == [0.0, 0.0, 0.0] and source.stats.generated == 1
    assert source.stats.sampled_tokens == 6, "every completion token the engine returned is counted"


def test_a_failed_request_drops_its_group_counted_by_error_type_and_the_stream_moves_on():
    async def generate(prompt, **kwargs):
        raise ConnectionError("vLLM went away")

    source, _ = _builtin(generate)
    buffer = RolloutBuffer(8)
    anyio.run(source.fill, buffer, 2)
    assert len(buffer) == 0 and source.stats.sampled_tokens == 0
    assert source.stats.dropped == 2 and source.stats.drop_reasons == {"ConnectionError": 2}
    assert source.cursor() == {"kind": "builtin", "next_index": 2}


def test_a_failure_repeated_on_every_group_is_one_console_line_per_interval_with_a_count(monkeypatch):
    """A source failing the same way on every group (a reward function that raises, an environment
    whose openings never fit) printed a line per group; the drops themselves are counted apart."""
    from structlog.testing import capture_logs

    from grpod.rollouts.sampling_source import ThrottledWarnings
    from grpod.service.logs import REPEAT_EVERY_S

    now = [100.0]
    monkeypatch.setattr(anyio, "current_time", lambda: now[0])
    warnings = ThrottledWarnings()
    with capture_logs() as logs:
        for _ in range(5):
            warnings.warn("episode_failed", "prompt_too_long", task=1)
        warnings.warn("episode_failed", "environment_timeout", task=2)  # another reason is said at once
        warnings.warn("reward_failed", "prompt_too_long")  # and another event
        now[0] += REPEAT_EVERY_S
        warnings.warn("episode_failed", "prompt_too_long", task=9)
        warnings.warn("episode_failed", "prompt_too_long", task=10)
    assert [(e["event"], e["reason"], e.get("task"), e.get("same_failures_not_shown")) for e in logs] == [
        ("episode_failed", "prompt_too_long", 1, None),
        ("episode_failed", "environment_timeout", 2, None),
        ("reward_failed", "prompt_too_long", None, None),
        ("episode_failed", "prompt_too_long", 9, 4),
    ]
