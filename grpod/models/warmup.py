"""Supervised warm-up of a policy on the arithmetic task, and HF-side measurements of the result.

A freshly initialised model never emits a well-formed answer, so GRPO would see only zero rewards.
`warmup` teaches the arithmetic by teacher forcing (prompt + answer + eos, loss on the answer and
eos tokens only). With `plus_sign_share` > 0 that share of the non-negative answers is written
with an explicit sign ("+12"), which the task's verifier rejects: the model learns the sums but
an answer style that GRPO has to unlearn, and unlearning it transfers to held-out problems (the
calibration and the measurements behind it are in `grpod.models.tiny`).

`generate` is a small batched decoding loop (greedy or plain temperature sampling, no top-k/top-p)
used to measure the policy with HF alone; prompts are grouped by length so that no padding enters
the computation and the greedy answers are the ones an unpadded forward pass gives.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpod.rollouts.arithmetic import (
    ArithmeticTask,
    Problem,
    answer_ids,
    prompt_ids,
    score,
)

log = structlog.get_logger(__name__)

IGNORE_INDEX = -100


class ModelInitStopped(Exception):
    """The model's build was asked to stop (the daemon is stopping) before it was saved."""


def check_stop(stop: threading.Event | None, where: str) -> None:
    """Raise `ModelInitStopped` if `stop` is set: a safe point of the build, `where`."""
    if stop is not None and stop.is_set():
        log.info("model_init_stopped", at=where)
        raise ModelInitStopped(f"the model's build was stopped {where}")


def teacher_forcing_batch(
    tokenizer: PreTrainedTokenizerBase,
    problems: list[Problem],
    cache: dict[tuple[str, str], tuple[list[int], list[int]]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask, and labels that are IGNORE_INDEX outside the answers.

    `cache` maps a (question, answer) to its (prompt, answer) tokens: the problem space is small
    and the chat template costs as much as a quarter of a training step.
    """
    rows = []
    for p in problems:
        key = (p.question, p.answer)
        if key not in cache:
            cache[key] = (prompt_ids(tokenizer, p), answer_ids(tokenizer, p))
        rows.append(cache[key])
    width = max(len(prompt) + len(answer) for prompt, answer in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (prompt, answer) in enumerate(rows):
        seq = prompt + answer
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        labels[i, len(prompt) : len(seq)] = torch.tensor(answer)
    return input_ids, attention, labels


def _styled(problem: Problem, rng: random.Random, plus_sign_share: float) -> Problem:
    """`problem` with its non-negative answer written "+12" with probability `plus_sign_share`."""
    if problem.answer.startswith("-") or rng.random() >= plus_sign_share:
        return problem
    return replace(problem, answer="+" + problem.answer)


def _learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 10 % of steps, then cosine decay to 10 % of the peak."""
    ramp = max(1, steps // 10)
    if step < ramp:
        return peak * (step + 1) / ramp
    progress = (step - ramp) / max(1, steps - ramp)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def warmup(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: ArithmeticTask,
    steps: int,
    seed: int,
    lr: float,
    batch_size: int,
    plus_sign_share: float = 0.0,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Fine-tune `model` in place on `steps` batches of training problems.

    `plus_sign_share`: the probability that a non-negative answer is written "+12" instead of "12"
    (drawn from its own stream, so the problems drawn do not depend on it).

    Returns the settings, `first_loss`, `final_loss` (mean over the last tenth of the steps; None
    for no steps) and `seconds`. Raises `ModelInitStopped` before the first step after `stop` is
    set (a step takes ~50 ms with one thread here).

    Deterministic from `seed` (problems drawn from `random.Random(seed)`, torch seeded likewise):
    the same model, seed and torch thread count give bitwise the same weights. Leaves the model in
    eval mode.
    """
    if steps < 0 or batch_size < 1 or lr <= 0 or not 0.0 <= plus_sign_share <= 1.0:
        raise ValueError(
            f"warmup needs steps >= 0, batch_size >= 1, lr > 0, 0 <= plus_sign_share <= 1; "
            f"got {steps}, {batch_size}, {lr}, {plus_sign_share}"
        )
    started = time.perf_counter()
    rng = random.Random(seed)
    style_rng = random.Random(f"{seed}:style")
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    losses: list[float] = []
    token_cache: dict[str, tuple[list[int], list[int]]] = {}
    for step in range(steps):
        check_stop(stop, f"at warm-up step {step} of {steps}")
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, steps, lr)
        problems = [task.sample(rng) for _ in range(batch_size)]
        problems = [_styled(p, style_rng, plus_sign_share) for p in problems]
        input_ids, attention, labels = teacher_forcing_batch(tokenizer, problems, token_cache)
        logits = model(input_ids=input_ids, attention_mask=attention).logits
        loss = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    tail = losses[-max(1, steps // 10) :]
    result = {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "plus_sign_share": plus_sign_share,
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "seconds": time.perf_counter() - started,
    }
    log.info("warmup_done", **result)
    return result


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    prompts: list[list[int]],
    *,
    eos_token_id: int,
    max_new_tokens: int,
    temperature: float | None = None,
    generator: torch.Generator | None = None,
    max_batch: int = 512,
) -> list[list[int]]:
    """Complete each prompt; `temperature=None` decodes greedily, otherwise samples from softmax(logits/T).

    Each completion stops after its first eos (included) or at `max_new_tokens`. The result is in
    the order of `prompts`.
    """
    by_length: dict[int, list[int]] = defaultdict(list)
    for index, prompt in enumerate(prompts):
        by_length[len(prompt)].append(index)
    completions: list[list[int]] = [[] for _ in prompts]
    for length in sorted(by_length):
        indices = by_length[length]
        for start in range(0, len(indices), max_batch):
            chunk = indices[start : start + max_batch]
            tokens = _decode_equal_length(
                model, torch.tensor([prompts[i] for i in chunk]), eos_token_id, max_new_tokens, temperature, generator
            )
            for i, row in zip(chunk, tokens, strict=True):
                completions[i] = row
    return completions


def _decode_equal_length(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    eos_token_id: int,
    max_new_tokens: int,
    temperature: float | None,
    generator: torch.Generator | None,
) -> list[list[int]]:
    batch = input_ids.shape[0]
    done = torch.zeros(batch, dtype=torch.bool)
    generated: list[torch.Tensor] = []
    out = model(input_ids=input_ids, use_cache=True)
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        if temperature is None:
            next_token = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        next_token = torch.where(done, torch.full_like(next_token, eos_token_id), next_token)
        generated.append(next_token)
        done |= next_token == eos_token_id
        if bool(done.all()):
            break
        out = model(input_ids=next_token[:, None], past_key_values=out.past_key_values, use_cache=True)
    rows = torch.stack(generated, dim=1).tolist()
    trimmed = []
    for row in rows:
        trimmed.append(row[: row.index(eos_token_id) + 1] if eos_token_id in row else row)
    return trimmed


def completion_text(tokenizer: PreTrainedTokenizerBase, completion: list[int]) -> str:
    return tokenizer.decode(completion, skip_special_tokens=False)


def greedy_answers(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: list[Problem], max_new_tokens: int = 8
) -> list[str]:
    """The decoded greedy completion of each problem (eos included when the model emitted it)."""
    completions = generate(
        model,
        [prompt_ids(tokenizer, p) for p in problems],
        eos_token_id=tokenizer.eos_token_id,
        max_new_tokens=max_new_tokens,
    )
    return [completion_text(tokenizer, c) for c in completions]


def greedy_accuracy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problems: list[Problem], max_new_tokens: int = 8
) -> float:
    """The share of `problems` whose greedy completion is exactly the answer."""
    if not problems:
        raise ValueError("greedy_accuracy needs at least one problem")
    texts = greedy_answers(model, tokenizer, problems, max_new_tokens)
    return sum(score(p, t) == 1.0 for p, t in zip(problems, texts, strict=True)) / len(problems)


def sampled_group_stats(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: list[Problem],
    *,
    group_size: int = 8,
    temperature: float = 1.0,
    seed: int = 0,
    max_new_tokens: int = 8,
) -> dict[str, float]:
    """How GRPO groups would look: sample `group_size` completions per problem and count outcomes.

    `mixed_share` is the share of problems whose group holds both right and wrong answers (the
    groups that carry a learning signal); `sample_accuracy` the share of right completions.
    """
    if not problems:
        raise ValueError("sampled_group_stats needs at least one problem")
    prompts = [prompt_ids(tokenizer, p) for p in problems for _ in range(group_size)]
    generator = torch.Generator().manual_seed(seed)
    completions = generate(
        model,
        prompts,
        eos_token_id=tokenizer.eos_token_id,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        generator=generator,
    )
    right = [
        score(problems[i // group_size], completion_text(tokenizer, c)) == 1.0 for i, c in enumerate(completions)
    ]
    groups = [right[i * group_size : (i + 1) * group_size] for i in range(len(problems))]
    return {
        "group_size": group_size,
        "temperature": temperature,
        "sample_accuracy": sum(right) / len(right),
        "mixed_share": sum(any(g) and not all(g) for g in groups) / len(groups),
        "all_right_share": sum(all(g) for g in groups) / len(groups),
        "all_wrong_share": sum(not any(g) for g in groups) / len(groups),
    }
