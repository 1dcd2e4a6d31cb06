"""Multi-turn tool episodes against the session's real vLLM (tiny random model), token in / token out:
each episode's training sequence is, id for id, what the engine returned for each turn plus the
tool turns rendered once; its loss mask covers exactly the engine's ids; the trainer's logprobs
match the engine's on every model token to the alignment probe's tolerance; and the group trains
one step through the real Trainer. Re-rendering the same conversation from its text would give
other ids: that is what the episode never does."""

from __future__ import annotations

import math
from types import SimpleNamespace

import anyio
import pytest
from transformers import AutoTokenizer

from grpod.bridges.probe import ProbeTolerance
from grpod.config import parse_config
from grpod.rollouts.chat_turns import ChatTurns
from grpod.rollouts.episode_runner import EpisodeLimits, EpisodeRunner
from grpod.rollouts.validation import validate_group
from grpod.training.trainer import build_trainer
from tests.rollouts.conftest import scripted_policy

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

USER = [{"role": "user", "content": "what is 12 plus 7 use the tool"}]
TOOL_REPLIES = ["12", "19"]
TEMPERATURE = 0.9
EPISODES = 4
SEED = 11


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiohttp needs asyncio


class ScriptedTool:
    """A fixed tool reply after each of the first two model turns; reward: characters written."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    async def respond(self, text: str):
        self.texts.append(text)
        turn = len(self.texts) - 1
        return [{"role": "tool", "content": TOOL_REPLIES[turn]}] if turn < len(TOOL_REPLIES) else None

    async def reward(self) -> float:
        return float(len("".join(self.texts)))


class RecordingClient:
    """The session server's client, recording every generation request and what came back."""

    def __init__(self, client) -> None:
        self.client = client
        self.calls: dict[int, tuple[list[int], object]] = {}  # by seed: the prompt, the completion

    async def generate(self, prompt_ids, **kwargs):
        completions = await self.client.generate(list(prompt_ids), **kwargs)
        self.calls[kwargs["seed"]] = (list(prompt_ids), completions[0])
        return completions


async def test_a_tool_episode_trains_on_the_engines_own_ids(vllm_server, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    turns = ChatTurns(tokenizer)
    tools = [ScriptedTool() for _ in range(EPISODES)]
    async with vllm_server.client() as client:
        await client.update_weight_version(2)  # the engine's label agrees with the policy's version
        recorder = RecordingClient(client)
        policy, _ = scripted_policy(recorder, version=2)
        runner = EpisodeRunner(
            policy, turns, EpisodeLimits(temperature=TEMPERATURE, max_tokens=24, max_turns=3, max_episode_tokens=256),
            engine_wait_s=30.0, environment_timeout_s=10.0,
        )
        with anyio.fail_after(120):
            group = await runner.play_group(USER, tools, group_id="tool-0", source="environment", seed=SEED)

    assert validate_group(group, vocab_size=len(tokenizer), max_seq_len=256, group_normalised=True) is None
    assert len(recorder.calls) == 3 * EPISODES, "every episode ran its three model turns"
    # One version sampled everything (no sync ran): the group's version says it for every token.
    assert group.policy_version == 2 and group.token_versions is None
    retokenised_differs = []
    for i, tool in enumerate(tools):
        tokens, mask, logprobs = group.tokens[i], group.loss_mask[i], group.inference_logprobs[i]
        # Rebuild the sequence from what the engine returned and the tool turns rendered once.
        expected, texts = turns.prompt(USER), []
        expected_mask = [0] * len(expected)
        for turn in range(3):
            prompt, completion = recorder.calls[SEED + 1000 * i + turn]  # episode i's turn (its seed)
            assert prompt == expected, f"episode {i} turn {turn} was not given exactly the episode so far"
            assert logprobs[len(expected) : len(expected) + len(completion.token_ids)] == completion.logprobs
            expected += completion.token_ids
            expected_mask += [1] * len(completion.token_ids)
            texts.append(completion.text)
            if turn < 2:
                following = turns.after_model_turn(completion.token_ids, [{"role": "tool", "content": TOOL_REPLIES[turn]}])
                expected += following
                expected_mask += [0] * len(following)
        assert tokens == expected, f"episode {i}: the training sequence is not the engine's ids plus the tool turns"
        assert mask == expected_mask, f"episode {i}: the loss mask is not exactly the engine's ids"
        assert group.scores[i] == float(len("".join(tool.texts))) and tool.texts == texts

        # The conversation's text, rendered again by the chat template, as a re-tokenising trainer
        # would see it (the same ids only where nothing was lost or re-merged in the text).
        conversation = [*USER]
        for turn, text in enumerate(texts):
            conversation.append({"role": "assistant", "content": text})
            if turn < 2:
                conversation.append({"role": "tool", "content": TOOL_REPLIES[turn]})
        rerendered = list(tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False))
        retokenised_differs.append(rerendered[: len(tokens)] != tokens)
    # With a random model, some sampled ids do not survive detokenisation (special tokens the
    # text drops, role words a re-tokenisation merges): there the re-rendering is another sequence.
    assert any(retokenised_differs), "expected at least one episode whose re-rendered text gives other ids"

    cfg = parse_config({"model": {"path": str(tiny_model_dir)}, "train": {"threads": 1, "lr": 1e-4}})
    trainer = build_trainer(cfg, tiny_model_dir)
    tolerance = ProbeTolerance.for_serving(cfg.model.dtype, cfg.bridge)
    worst = 0.0
    for tokens, mask, logprobs in zip(group.tokens, group.loss_mask, group.inference_logprobs, strict=True):
        scored = trainer.score(tokens, temperature=TEMPERATURE)  # scored[t - 1]: logprob of tokens[t]
        worst = max([worst] + [abs(scored[t - 1] - logprobs[t]) for t in range(1, len(tokens)) if mask[t]])
    assert worst <= tolerance.max_abs, f"trainer vs engine logprob differs by {worst} on a model token ({tolerance.describe()})"

    metrics = trainer.train_step([group])
    assert metrics["skipped"] == 0.0 and math.isfinite(metrics["loss"])
    assert metrics["loss_tokens"] == sum(sum(m) for m in group.loss_mask)
    assert metrics["logprob_diff_max"] <= tolerance.max_abs
