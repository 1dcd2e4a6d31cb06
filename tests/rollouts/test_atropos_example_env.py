"""The example Atropos environment (etc/examples/atropos/arith_env.py) and its transformers 5 shim,
without vLLM or run-api: the groups it builds on both routes are what grpod's Atropos conversion
accepts, token for token. The tokenizer is grpod's tiny one (it has a chat template), so no model
is needed; tests/e2e/test_atropos_readme.py runs the environment for real.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest
import transformers
from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer

from grpod.config import load_config
from grpod.models.tiny import build_tokenizer
from grpod.rollouts.atropos_wire import group_from_atropos
from grpod.rollouts.validation import validate_batch

EXAMPLE = Path(__file__).resolve().parents[2] / "etc" / "examples" / "atropos" / "arith_env.py"
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def load_example():
    spec = importlib.util.spec_from_file_location("arith_env", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # pydantic resolves the config's annotations there
    spec.loader.exec_module(module)
    return module


arith_env = load_example()
CHAT = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("chat-tokenizer")
    build_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.skipif(not TRANSFORMERS_5, reason="the defect is transformers 5's BatchEncoding")
def test_tokenize_for_trainer_breaks_without_the_shim(tokenizer):
    """Why the shim exists: atroposlib 0.4.0 gets a BatchEncoding and the send fails on JSON."""
    out = tokenize_for_trainer(tokenizer, CHAT)
    assert isinstance(out["tokens"], transformers.BatchEncoding)
    with pytest.raises(TypeError, match="not JSON serializable"):
        json.dumps(out)


def test_tokenize_for_trainer_through_the_shim_gives_ids_and_masks(tokenizer):
    out = tokenize_for_trainer(arith_env.ChatTemplateIds(tokenizer), CHAT)
    prompt = arith_env.tokenize_chat(tokenizer, CHAT[:1], add_generation_prompt=True)
    full = arith_env.tokenize_chat(tokenizer, CHAT, add_generation_prompt=False)
    assert json.loads(json.dumps(out)) == out
    assert out["tokens"] == full and all(type(t) is int for t in full)
    assert out["masks"] == [-100] * len(prompt) + full[len(prompt):]
    assert full[: len(prompt)] == prompt and len(full) > len(prompt)
    assert tokenizer.decode(full[len(prompt):]).startswith("5")


def test_the_shim_leaves_text_rendering_and_the_rest_of_the_tokenizer_alone(tokenizer):
    shim = arith_env.ChatTemplateIds(tokenizer)
    assert shim.apply_chat_template(CHAT, tokenize=False) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert shim.decode(shim.encode("12")) == "12"
    assert len(shim) == len(tokenizer) and shim.eos_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize(
    ("text", "expected", "reward"),
    [("5", 5, 1.0), ("The answer is 42.", 42, 1.0), ("3 - 7 = -4", -4, 1.0), ("12, no 13", 12, 0.0), ("five", 5, 0.0)],
)
def test_the_last_integer_of_the_answer_is_scored(text, expected, reward):
    assert arith_env.score(text, expected) == reward


def make_env(tokenizer_dir: Path, route: str):
    env_config, servers = arith_env.ArithEnv.config_init()
    env_config = env_config.model_copy(update={"tokenizer_name": str(tokenizer_dir), "route": route})
    servers = [servers[0].model_copy(update={"model_name": str(tokenizer_dir)})]
    return arith_env.ArithEnv(env_config, servers)


def convert(group: dict, tokenizer) -> list:
    """What grpod does with the group once run-api hands it over (JSON on the way); the daemon
    accepts groups without inference logprobs (they train with IS weight 1)."""
    received = group_from_atropos(json.loads(json.dumps(group)), default_version=0)
    valid, rejected = validate_batch(
        [received], vocab_size=len(tokenizer), max_seq_len=128, group_normalised=True, require_logprobs=False
    )
    assert rejected == []
    return valid


def test_the_generate_route_sends_the_sampled_ids_with_their_logprobs(tokenizer_dir, tokenizer):
    env = make_env(tokenizer_dir, "generate")
    answers = ["5", "6", "it is 5", "7"]
    calls = []

    async def tokens_and_logprobs_completion(**request):
        calls.append(request)
        outputs = [tokenizer.encode(a) + [tokenizer.eos_token_id] for a in answers]
        logprobs = [[-0.5 - 0.1 * i for i in range(len(o))] for o in outputs]
        return request["input_ids"], outputs, logprobs, ["stop"] * len(outputs)

    env.server.tokens_and_logprobs_completion = tokens_and_logprobs_completion
    group, backlog = anyio.run(env.collect_trajectories, ("What is 2 + 3? Answer with the number only.", 5))

    prompt = arith_env.tokenize_chat(tokenizer, [{"role": "user", "content": "What is 2 + 3? Answer with the number only."}], add_generation_prompt=True)
    assert backlog == []
    assert calls == [{"input_ids": prompt, "n": 4, "max_tokens": 24, "temperature": 0.8, "top_p": 1.0}]
    assert group["scores"] == [1.0, 0.0, 1.0, 0.0]
    assert group["generation_params"] == {"temperature": 0.8}
    [received] = convert(group, tokenizer)
    assert received.temperature == 0.8
    for tokens, mask, logprobs, answer in zip(received.tokens, received.loss_mask, received.inference_logprobs, answers):
        completion = tokenizer.encode(answer) + [tokenizer.eos_token_id]
        assert tokens == prompt + completion
        assert mask == [0] * len(prompt) + [1] * len(completion)
        assert logprobs[len(prompt):] == pytest.approx([-0.5 - 0.1 * i for i in range(len(completion))])
        assert logprobs[: len(prompt)] == [0.0] * len(prompt)


def test_the_chat_route_tokenizes_the_answers_through_the_shim(tokenizer_dir, tokenizer):
    env = make_env(tokenizer_dir, "chat")
    answers = ["5", "4"]

    async def chat_completion(**request):
        assert request["messages"][-1]["role"] == "user" and request["temperature"] == 0.8
        choices = [SimpleNamespace(message=SimpleNamespace(content=a), finish_reason="stop") for a in answers * 2]
        return SimpleNamespace(choices=choices)

    env.server.chat_completion = chat_completion
    group, _ = anyio.run(env.collect_trajectories, ("What is 2 + 3? Answer with the number only.", 5))
    assert group["scores"] == [1.0, 0.0, 1.0, 0.0]
    [received] = convert(group, tokenizer)
    assert received.temperature == 0.8 and received.inference_logprobs is None
    for tokens, mask, answer in zip(received.tokens, received.loss_mask, answers * 2):
        chat = [{"role": "user", "content": "What is 2 + 3? Answer with the number only."}, {"role": "assistant", "content": answer}]
        assert tokens == arith_env.tokenize_chat(tokenizer, chat, add_generation_prompt=False)
        trained = tokenizer.decode([t for t, m in zip(tokens, mask) if m])
        assert trained.startswith(answer)


def test_the_readme_commands_the_environment_and_the_grpod_config_agree():
    """docs/atropos.md's three commands, the environment's defaults and grpod-atropos.toml name the
    same ports, group size and model, so the commands work as written."""
    page = (EXAMPLE.parents[3] / "docs" / "atropos.md").read_text()
    commands = page.split("```sh", 1)[1].split("```", 1)[0]
    config_path = EXAMPLE.parent / "grpod-atropos.toml"
    cfg = load_config(config_path)
    env_config, [server] = arith_env.ArithEnv.config_init()
    run_api_port = int(re.search(r"run-api --host 127\.0\.0\.1 --port (\d+)", commands).group(1))
    assert f"grpod start --config {config_path.relative_to(EXAMPLE.parents[3])}" in commands
    assert f"--openai.base_url http://127.0.0.1:{cfg.inference.port}/v1" in commands
    assert f"--env.rollout_server_url http://127.0.0.1:{run_api_port}" in commands
    assert cfg.source.atropos_url == env_config.rollout_server_url == f"http://127.0.0.1:{run_api_port}"
    assert server.base_url == f"http://127.0.0.1:{cfg.inference.port}/v1" and server.server_type == "vllm"
    assert server.model_name == env_config.tokenizer_name == str(cfg.model.path)
    assert env_config.group_size == cfg.source.group_size
    assert cfg.source.kind == "atropos" and cfg.inference.port != 0
    assert env_config.total_steps == -1 and env_config.use_wandb is False
