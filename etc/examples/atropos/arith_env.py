"""An Atropos environment for grpod: integer arithmetic questions to an instruct model.

    .venv/bin/python etc/examples/atropos/arith_env.py serve \\
        --openai.base_url http://127.0.0.1:9001/v1 --env.rollout_server_url http://127.0.0.1:8000

It is a plain atroposlib 0.4.0 `BaseEnv` (no grpod import): it asks "What is 17 + 25? Answer with
the number only.", samples `env.group_size` answers, scores each 1.0 when the last integer in it is
the right result (else 0.0), and posts the scored group to run-api, which hands it to grpod.
docs/atropos.md ("Train with an Atropos environment") runs it with `etc/examples/atropos/grpod-atropos.toml`.

Two ways to reach the model, `--env.route`:
- `generate` (the default): `POST /generate` on grpod's vLLM (atroposlib's `server_type="vllm"`):
  the prompt goes in as token ids and the completion comes back as token ids with the logprob
  vLLM sampled each with. The group carries them as `inference_logprobs`, so grpod's importance
  correction (train.loss.tis_mode) sees the real sampling distribution, and the trained tokens
  are exactly the sampled ones.
- `chat`: `POST /v1/chat/completions` (any OpenAI-compatible server). Only text comes back; the
  answer is tokenized again with atroposlib's `tokenize_for_trainer`, and the group has no
  inference logprobs (grpod trains those tokens with importance weight 1).

Either way the group declares its sampling temperature in `generation_params`: grpod divides the
trainer's logits by it, and takes a group that declares none as sampled at T = 1.0.

The transformers 5 shim: from transformers 5, `tokenizer.apply_chat_template(chat)` returns a
`BatchEncoding` (a dict of `input_ids` and `attention_mask`) instead of a list of ids.
atroposlib 0.4.0's `tokenize_for_trainer` calls it that way, so its tokens are a `BatchEncoding`,
its masks are cut at the wrong length, and the group fails to serialise to JSON at the send:
nothing reaches run-api. This environment's tokenizer is wrapped in `ChatTemplateIds`, which
asks for the plain list (`return_dict=False`, which transformers 4.x accepts too), so
`tokenize_for_trainer(self.tokenizer, chat)` works on both. vLLM 0.32 needs transformers 5, so
pinning transformers 4 is not an option. Copy the class (or `tokenize_chat`) into your own
environments; it is harmless once atroposlib asks for the list itself.
"""

import random
import re
from typing import Any, Literal

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer
from pydantic import Field

MODEL = "models/smollm2-135m"  # `make model-smollm2`; grpod serves the model under this path too
QUESTION = "What is {a} {op} {b}? Answer with the number only."
INTEGER = re.compile(r"-?\d+")


class ChatTemplateIds:
    """A tokenizer whose `apply_chat_template` returns a list of token ids when it tokenizes.

    Everything else is the wrapped tokenizer's. Under transformers 5 a tokenizing
    `apply_chat_template` returns a `BatchEncoding` unless told `return_dict=False`; atroposlib's
    `tokenize_for_trainer` (and code written for transformers 4) expects the list.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("tokenize", True):
            kwargs.setdefault("return_dict", False)
        return self.tokenizer.apply_chat_template(conversation, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer(*args, **kwargs)


def tokenize_chat(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> list[int]:
    """The chat template's token ids as a list of ints, under transformers 4 and 5 alike."""
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    return [int(i) for i in ids]


def last_integer(text: str) -> int | None:
    """The last integer written in `text` ("The answer is 42." → 42), or None."""
    found = INTEGER.findall(text)
    return int(found[-1]) if found else None


def score(answer_text: str, expected: int) -> float:
    return 1.0 if last_integer(answer_text) == expected else 0.0


class ArithEnvConfig(BaseEnvConfig):
    route: Literal["generate", "chat"] = Field(
        default="generate",
        description="generate: POST /generate (token ids + vLLM logprobs); chat: /v1/chat/completions (text only)",
    )
    temperature: float = Field(default=0.8, gt=0, description="sampling temperature, declared in every group")
    max_new_tokens: int = Field(default=24, ge=1, description="completion length cap")
    # Groups whose answers all score alike are not sent (BaseEnv's ensure_scores_are_not_same), so
    # their generation is wasted. Measured with SmolLM2-135M at T = 0.8: operands up to 19, 12 of
    # 35 groups of 4 mixed right and wrong answers; up to 50, 12 of 62.
    max_operand: int = Field(default=19, ge=1, description="operands are drawn from 0..max_operand")
    seed: int = Field(default=0, description="seed of the question stream")


class ArithEnv(BaseEnv):
    name = "arith"
    env_config_cls = ArithEnvConfig

    def __init__(self, config: ArithEnvConfig, server_configs: Any, slurm: bool = False, testing: bool = False):
        super().__init__(config, server_configs, slurm=slurm, testing=testing)
        self.tokenizer = ChatTemplateIds(self.tokenizer)
        self.rng = random.Random(config.seed)

    @classmethod
    def config_init(cls) -> tuple[ArithEnvConfig, list[APIServerConfig]]:
        env = ArithEnvConfig(
            tokenizer_name=MODEL,
            group_size=4,  # a power of two dividing grpod's train.groups_per_step × source.group_size
            rollout_server_url="http://127.0.0.1:8000",
            total_steps=-1,  # take grpod's train.steps from run-api, and stop once they are covered
            max_num_workers=2,  # groups in flight: one step's worth keeps a CPU vLLM busy
            max_batches_offpolicy=2,
            max_token_length=128,
            steps_per_eval=0,  # no evaluation: grpod's training metrics tell the story here
            use_wandb=False,
            wandb_name="arith",
        )
        server = APIServerConfig(
            model_name=MODEL,  # a name grpod's vLLM serves (full-weight modes); also the tokenizer
            base_url="http://127.0.0.1:9001/v1",  # grpod's inference.port
            api_key="none",
            server_type="vllm",
            num_max_requests_at_once=8,
            num_requests_for_eval=8,
            timeout=600,
        )
        return env, [server]

    async def setup(self) -> None:
        pass

    async def get_next_item(self) -> tuple[str, int]:
        a, b = self.rng.randint(0, self.config.max_operand), self.rng.randint(0, self.config.max_operand)
        op = self.rng.choice("+-")
        return QUESTION.format(a=a, op=op, b=b), a + b if op == "+" else a - b

    async def collect_trajectories(self, item: tuple[str, int]) -> tuple[ScoredDataGroup | None, list]:
        question, expected = item
        messages = [{"role": "user", "content": question}]
        if self.config.route == "generate":
            group = await self._sample_token_ids(messages, expected)
        else:
            group = await self._sample_chat(messages, expected)
        group["generation_params"] = {"temperature": self.config.temperature}
        return group, []

    async def _sample_token_ids(self, messages: list[dict[str, str]], expected: int) -> ScoredDataGroup:
        prompt = tokenize_chat(self.tokenizer, messages, add_generation_prompt=True)
        prompt, outputs, logprobs, finish_reasons = await self.server.tokens_and_logprobs_completion(
            input_ids=prompt,
            n=self.config.group_size,
            max_tokens=self.config.max_new_tokens,
            temperature=self.config.temperature,
            top_p=1.0,
        )
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[], overrides=[])
        for completion, completion_logprobs, finish_reason in zip(outputs, logprobs, finish_reasons):
            text = self.tokenizer.decode(completion, skip_special_tokens=True)
            group["tokens"].append(prompt + completion)
            group["masks"].append([-100] * len(prompt) + completion)
            group["inference_logprobs"].append([1.0] * len(prompt) + completion_logprobs)
            group["scores"].append(score(text, expected))
            group["overrides"].append({"finish_reason": finish_reason})
        return group

    async def _sample_chat(self, messages: list[dict[str, str]], expected: int) -> ScoredDataGroup:
        completion = await self.server.chat_completion(
            messages=messages,
            n=self.config.group_size,
            max_tokens=self.config.max_new_tokens,
            temperature=self.config.temperature,
            top_p=1.0,
        )
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], overrides=[])
        for choice in completion.choices:
            text = choice.message.content or ""
            chat = [*messages, {"role": "assistant", "content": text}]
            tokenized = tokenize_for_trainer(self.tokenizer, chat, finish_reason=choice.finish_reason)
            group["tokens"].append(tokenized["tokens"])
            group["masks"].append(tokenized["masks"])
            group["scores"].append(score(text, expected))
            group["overrides"].append({"finish_reason": choice.finish_reason})
        return group

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        """No held-out evaluation in this example (`env.steps_per_eval = 0` never calls it)."""


if __name__ == "__main__":
    ArithEnv.cli()
