"""One workload for two trainers: what a grpod config runs, restated for TRL's GRPOTrainer.

Both sides of `bench/peers/compare.py` start from the same effective grpod config (the TOML file
plus the same `--set` overrides). grpod reads it itself; `trl_runner.py` reads it through this
module, which takes every task-defining value from grpod's own code rather than re-deriving it:

- prompts: the builtin source's problem stream (`ArithmeticTask.sample` with the rng grpod's
  `BuiltinSource` seeds per index, `source.task_seed:index`) or the dataset source's epoch order
  (`DatasetSource.peek_rows`), the prompt as chat messages whose chat-template tokens are checked
  equal to the tokens grpod sends vLLM (`ArithmeticTask.prompt_for`, `DatasetItem.prompt_ids`);
- the reward: `ArithmeticTask.score` (the builtin verifier) or the weighted sum of the dataset
  source's reward functions (called as TRL calls them, results checked by `checked_rewards`);
- the held-out set: `ArithmeticTask.eval_set(eval.size)` or the first `eval.size` rows of
  `eval.dataset`, with grpod's completion budget for it and its correctness rule (score >= 1.0 for
  the builtin task, combined reward >= `eval.correct_threshold` for a dataset);
- the completion budget: the source's effective `max_tokens` (the builtin source raises it to 24
  for an instruct model).

`grpo_config_kwargs` maps the training knobs onto `GRPOConfig`; `compare.py`'s docstring lists
the mapping and what could not be made equal.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the grpod of this checkout, whatever the venv's editable install points at
    sys.path.insert(0, str(ROOT))

from grpod.config import GrpodConfig, load_config  # noqa: E402
from grpod.rollouts.arithmetic import Problem, instruct_question  # noqa: E402
from grpod.rollouts.dataset import prepare_dataset, read_rows  # noqa: E402
from grpod.rollouts.rewards import TrainerState, checked_rewards, combine, resolve_function  # noqa: E402
from grpod.rollouts.kinds import make_source  # noqa: E402
from grpod.rollouts.validation import RejectionCounter  # noqa: E402

# Keys TRL itself passes to reward functions or reads from a dataset row; a dataset column with one
# of these names could not reach the reward unchanged.
TRL_RESERVED = ("prompt", "completion", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


async def _checked_inputs(cfg: GrpodConfig):
    prepared = await prepare_dataset(cfg)
    await prepared.scorer.aclose()
    return prepared


class WorkloadError(Exception):
    """The grpod config uses something this benchmark cannot express for TRL; the message says what."""


@dataclass(frozen=True)
class Example:
    """One prompt: chat messages for TRL, the token ids grpod sends vLLM, and the columns its
    reward needs (the builtin task: the problem; a dataset: the row's other columns)."""

    messages: list[dict[str, str]]
    prompt_ids: list[int]
    columns: dict[str, Any]


class Workload:
    """The task a grpod config trains on, for a trainer other than grpod's."""

    def __init__(self, cfg: GrpodConfig, tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        kind = cfg.source.kind
        if kind == "builtin":
            self.source = make_source(cfg, tokenizer, None, None, RejectionCounter())
            self.eval_max_tokens = cfg.eval.max_tokens
            if self.source.task.prompt_style == "instruct":
                self.eval_max_tokens = max(cfg.eval.max_tokens, self.source.max_tokens)
        elif kind == "dataset":
            # The rows as grpod's source checks and tokenizes them; the rewards are called here, in
            # process, as TRL calls them (`scores`), so the reward workers are closed at once.
            prepared = anyio.run(_checked_inputs, cfg)
            self.source = make_source(cfg, tokenizer, None, None, RejectionCounter(), prepared)
            self.eval_max_tokens = max(cfg.eval.max_tokens, self.source.max_tokens)
            clash = [name for name in self.source.items[0].columns if name in TRL_RESERVED]
            if clash:
                raise WorkloadError(f"{cfg.source.dataset.path}: column {clash[0]!r} is a name TRL reserves; rename it")
        else:
            raise WorkloadError(f"source.kind = {kind!r}: only 'builtin' and 'dataset' sample their own prompts")
        self.kind = kind
        self.max_tokens = self.source.max_tokens

    # ---- prompts ------------------------------------------------------------------------------

    def _builtin_example(self, problem: Problem) -> Example:
        task = self.source.task
        content = instruct_question(problem) if task.prompt_style == "instruct" else problem.question
        columns = {"question": problem.question, "answer": problem.answer, "id": problem.id}
        return Example([{"role": "user", "content": content}], task.prompt_for(self.tokenizer, problem), columns)

    def _dataset_example(self, item, rows: list[dict]) -> Example:
        row = rows[item.row]
        dcfg = self.cfg.source.dataset
        if dcfg.messages_column in row:
            messages = [{"role": m["role"], "content": m["content"]} for m in row[dcfg.messages_column]]
        else:
            messages = [{"role": "user", "content": row[dcfg.prompt_column]}]
        if dcfg.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": dcfg.system_prompt}, *messages]
        return Example(messages, list(item.prompt_ids), {**item.columns, "prompt_text": item.prompt_text})

    def train_examples(self, count: int) -> list[Example]:
        """The first `count` prompts grpod's source draws, in its order."""
        if self.kind == "builtin":
            return [self._builtin_example(self.source.problem_at(i)) for i in range(count)]
        order = self.source.peek_rows(count)
        if len(order) < count:
            raise WorkloadError(
                f"source.dataset.epochs = {self.cfg.source.dataset.epochs} gives {len(order)} prompts, fewer than {count}"
            )
        rows = read_rows(Path(self.cfg.source.dataset.path))
        return [self._dataset_example(self.source.items[row], rows) for row in order]

    def eval_examples(self) -> list[Example]:
        """The held-out problems grpod evaluates, in its order."""
        if self.kind == "builtin":
            return [self._builtin_example(p) for p in self.source.task.eval_set(self.cfg.eval.size)]
        rows = read_rows(Path(self.cfg.eval.dataset))
        return [self._dataset_example(item, rows) for item in self.source.eval_items[: self.cfg.eval.size]]

    def check_prompt_tokens(self, examples: list[Example]) -> None:
        """TRL renders conversational prompts with `apply_chat_template(..., add_generation_prompt=True)`;
        the tokens must be the ones grpod sends vLLM, or the two sides train on different prompts."""
        for example in examples:
            rendered = self.tokenizer.apply_chat_template(
                conversation=[example.messages], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"][0]
            if list(rendered) != list(example.prompt_ids):
                raise WorkloadError(
                    f"TRL's prompt tokens differ from grpod's for {example.messages!r}:\n  TRL   {list(rendered)}\n"
                    f"  grpod {list(example.prompt_ids)}"
                )

    # ---- reward -------------------------------------------------------------------------------

    def scores(self, rows: list[dict[str, Any]], texts: list[str], token_ids: list[list[int]]) -> list[float]:
        """The reward grpod gives each completion: `rows[i]` holds completion i's prompt columns."""
        return self.scored(rows, texts, token_ids)[0]

    def scored(self, rows: list[dict[str, Any]], texts: list[str],
               token_ids: list[list[int]]) -> tuple[list[float], dict[str, list[float]]]:
        """(the combined reward of each completion, each reward function's own rewards by its
        metric name); the builtin task has one function, its verifier."""
        if self.kind == "builtin":
            task = self.source.task
            combined = [
                task.score(Problem(question=r["question"], answer=r["answer"], id=r["id"]), text)
                for r, text in zip(rows, texts, strict=True)
            ]
            return combined, {"verifier": combined}
        n = len(texts)
        names = [k for k in rows[0] if k != "prompt_text"]
        columns = {name: [r[name] for r in rows] for name in names}
        prompts = [r["prompt_text"] for r in rows]
        functions = self.source.functions
        per_function = [
            checked_rewards(f.name, resolve_function(f.function, f.pattern)(
                prompts=prompts, completions=texts, completion_ids=token_ids, trainer_state=TrainerState(), **columns), n)
            for f in functions
        ]
        combined = combine(per_function, [f.weight for f in functions], self.cfg.source.dataset.reward_aggregation)
        by_name = {f.name: [0.0 if v is None else v for v in values] for f, values in zip(functions, per_function, strict=True)}
        return [0.0 if score is None else score for score in combined], by_name

    def trl_reward_functions(self) -> tuple[list[Any], list[float]] | None:
        """The dataset's own reward functions and weights, to hand TRL unchanged, when its rows are
        conversational (`messages`): then TRL calls them exactly as grpod does. None otherwise: a
        string-prompt row is a string for grpod's functions but chat messages for TRL (the bench
        renders every prompt with the chat template), so `scores` stands in for them."""
        if self.kind != "dataset" or not self.source.items[0].chat:
            return None
        functions = []
        for f in self.source.functions:
            fn = resolve_function(f.function, f.pattern)
            if not hasattr(fn, "__name__"):  # a builtin with its pattern bound: TRL names functions
                fn = _named(fn, f.name)
            functions.append(fn)
        return functions, [f.weight for f in self.source.functions]

    def correct(self, score: float) -> bool:
        threshold = 1.0 if self.kind == "builtin" else self.cfg.eval.correct_threshold
        return score >= threshold


def eos_token_ids(model, tokenizer) -> list[int]:
    """The tokens that end a completion: the model's generation config's, and the tokenizer's."""
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return eos if tokenizer.eos_token_id in eos else [*eos, tokenizer.eos_token_id]


def gradient_tokens(scores: list[float], completion_ids: list[list[int]], group_size: int, max_tokens: int,
                    eos_ids: set[int], mask_truncated: bool) -> int:
    """Completion tokens that reach a gradient in TRL's step: `scores` come in groups of
    `group_size` consecutive completions of one prompt (TRL's sampler repeats each prompt so), a
    completion's advantage is its reward less its group's mean (then scaled), so it is non-zero
    unless the reward equals that mean; a truncated completion (no EOS within `max_tokens`) counts
    nothing when `mask_truncated`. grpod's trainer counts its own the same way (`gradient_tokens`)."""
    if len(scores) % group_size:
        raise ValueError(f"{len(scores)} rewards are not whole groups of {group_size}")
    counted = 0
    for start in range(0, len(scores), group_size):
        group = scores[start : start + group_size]
        mean = sum(group) / group_size
        for score, ids in zip(group, completion_ids[start : start + group_size], strict=True):
            truncated = len(ids) >= max_tokens and not eos_ids.intersection(ids)
            if abs(score - mean) > 1e-9 and not (mask_truncated and truncated):
                counted += len(ids)
    return counted


@dataclass
class HeldOut:
    """One evaluation: `correct` of `size` rows by the config's correctness rule, the summed
    combined reward, and per reward function (metric name) how many rows it gave full credit
    (>= 1.0) and its summed reward: a format reward and a correctness reward apart. `rows`: each
    held-out row's outcome in order (1 correct, 0 not), so two sides scored on the same rows can be
    compared row by row (a paired difference)."""

    correct: int = 0
    size: int = 0
    summed: float = 0.0
    full_credit: dict[str, int] = field(default_factory=dict)
    function_summed: dict[str, float] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        size = max(self.size, 1)
        return {"correct": self.correct, "size": self.size, "accuracy": self.correct / size,
                "mean_score": self.summed / size,
                "functions": {name: {"full_credit": full, "mean": self.function_summed[name] / size}
                              for name, full in self.full_credit.items()},
                "rows": self.rows}


def held_out_accuracy(model, tokenizer, workload: Workload, held_out: list[Example], batch: int) -> HeldOut:
    """Greedy HF generate of `model` on `held_out`, `batch` prompts per call (left-padded), each
    completion cut at its first EOS and scored by grpod's reward and correctness rule. The one
    evaluator of both sides' weights (`evaluate.py`), and TRL's in-run evaluation (`trl_runner.py`)."""
    import torch
    from transformers import GenerationConfig

    was_training = model.training
    model.eval()
    eos = eos_token_ids(model, tokenizer)
    greedy = GenerationConfig(
        do_sample=False, max_new_tokens=workload.eval_max_tokens, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
    )
    result = HeldOut(size=len(held_out))
    with torch.no_grad():
        for start in range(0, len(held_out), batch):
            chunk = held_out[start : start + batch]
            width = max(len(e.prompt_ids) for e in chunk)
            ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(e.prompt_ids)) + e.prompt_ids for e in chunk])
            mask = torch.tensor([[0] * (width - len(e.prompt_ids)) + [1] * len(e.prompt_ids) for e in chunk])
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=greedy)[:, width:].tolist()
            completions = []
            for seq in out:
                stop = next((i for i, t in enumerate(seq) if t in eos), None)
                completions.append(seq if stop is None else seq[: stop + 1])
            texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
            scores, by_name = workload.scored([e.columns for e in chunk], texts, completions)
            outcomes = [int(workload.correct(s)) for s in scores]
            result.rows += outcomes
            result.correct += sum(outcomes)
            result.summed += sum(scores)
            for name, values in by_name.items():
                result.full_credit[name] = result.full_credit.get(name, 0) + sum(v >= 1.0 for v in values)
                result.function_summed[name] = result.function_summed.get(name, 0.0) + sum(values)
    model.train(was_training)
    return result


def load(config: Path, overrides: list[str]) -> GrpodConfig:
    return load_config(config, overrides)


def _named(fn, name: str):
    def named(**kwargs):
        return fn(**kwargs)

    named.__name__ = name
    return named


# grpod's source.dataset.reward_aggregation -> TRL's multi_objective_aggregation.
AGGREGATIONS = {"sum": "sum_then_normalize", "normalize_then_sum": "normalize_then_sum"}


def grpo_config_kwargs(cfg: GrpodConfig, completion_tokens: int) -> dict[str, Any]:
    """GRPOConfig keyword arguments for the training knobs of `cfg` (compare.py documents each).
    Raises WorkloadError for a knob with no TRL counterpart wired here."""
    train, loss, adv = cfg.train, cfg.train.loss, cfg.train.advantages
    unsupported = []
    if train.lora:
        unsupported.append("train.lora = true")
    if train.optimizer != "adamw":
        unsupported.append(f"train.optimizer = {train.optimizer!r}")
    if train.minibatches != 1:
        unsupported.append(f"train.minibatches = {train.minibatches}")
    if loss.type not in ("grpo", "dapo", "dr_grpo", "cispo") or loss.aggregation != {
        "grpo": "token_mean", "dapo": "token_mean", "cispo": "token_mean", "dr_grpo": "seq_mean_token_sum_norm",
    }[loss.type]:
        unsupported.append(f"train.loss.type = {loss.type!r} with aggregation {loss.aggregation!r}")
    if loss.entropy_coef > 0:
        unsupported.append("train.loss.entropy_coef > 0")
    if adv.estimator != "grpo":
        unsupported.append(f"train.advantages.estimator = {adv.estimator!r}")
    if adv.std != "sample":
        unsupported.append("train.advantages.std = 'population' (TRL: sample std)")
    if adv.overlong_buffer:
        unsupported.append("train.advantages.overlong_buffer > 0")
    if cfg.source.kind == "dataset" and cfg.source.dataset.curriculum is not None:
        unsupported.append("source.dataset.curriculum (TRL draws from a fixed dataset; run grpod alone: --sides grpod)")
    if loss.kl_coef > 0 and loss.kl_reference != "model":
        unsupported.append("train.loss.kl_coef > 0 against the inference logprobs (TRL: a reference model)")
    if unsupported:
        raise WorkloadError("no TRL mapping wired for: " + "; ".join(unsupported))
    batch = train.groups_per_step * cfg.source.group_size
    schedule = {"constant": "constant_with_warmup" if train.warmup_steps else "constant", "cosine": "cosine"}
    return {
        "max_steps": train.steps,
        "per_device_train_batch_size": batch,
        "gradient_accumulation_steps": 1,
        "generation_batch_size": batch,
        "num_generations": cfg.source.group_size,
        "num_iterations": train.epochs,
        "learning_rate": train.lr,
        "lr_scheduler_type": schedule[train.schedule],
        "warmup_steps": train.warmup_steps,
        "weight_decay": train.weight_decay,
        "max_grad_norm": train.grad_clip,
        # TRL's default optimizer (adamw_torch_fused): torch's AdamW update, as grpod's, in one fused kernel.
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        "max_completion_length": completion_tokens,
        "temperature": cfg.source.temperature,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": None,
        "repetition_penalty": 1.0,
        "beta": loss.kl_coef,
        "epsilon": loss.clip_low,
        "epsilon_high": loss.clip_high,
        "loss_type": {"grpo": "dapo", "dapo": "dapo", "dr_grpo": "dr_grpo", "cispo": "cispo"}[loss.type],
        "scale_rewards": adv.scale,
        "mask_truncated_completions": loss.mask_truncated,
        "disable_dropout": train.disable_dropout,
        "gradient_checkpointing": cfg.model.gradient_checkpointing,
        "seed": cfg.run.seed,
        "shuffle_dataset": False,
        "bf16": False,
        "fp16": False,
        "use_cpu": train.device == "cpu",
        "use_vllm": False,
        "save_strategy": "steps" if cfg.checkpoint.every else "no",
        "save_steps": cfg.checkpoint.every or 500,
        "save_total_limit": cfg.checkpoint.keep_last,
        "logging_steps": 1,
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "log_completions": False,
    }
