"""Reward functions written exactly as TRL's GRPOTrainer documentation writes them, for grpod.

grpod calls them as TRL does: by keyword, `prompts` / `completions` as chat messages for this
conversational dataset (a `messages` column), every other column (`answer`) as a list with one
entry per completion, `trainer_state` and `log_metric` too; a function takes `**kwargs` for what it
does not read. The same module trains under TRL's GRPOTrainer unchanged
(tests/rollouts/test_trl_rewards.py runs one TRL step with it).

Named in etc/examples/trl-rewards.toml.
"""

import asyncio
import re

_INTEGER = re.compile(r"-?\d+")


def _text(completion):
    return completion[0]["content"]  # conversational data: one assistant message


def correct(completions, answer, **kwargs):
    """1.0 when the completion's last integer is the answer, else 0.0."""
    rewards = []
    for completion, gold in zip(completions, answer):
        found = _INTEGER.findall(_text(completion))
        rewards.append(1.0 if found and int(found[-1]) == int(gold) else 0.0)
    return rewards


def reward_len(completions, **kwargs):
    """TRL's quick-start shape: prefer short answers (0 at 4 characters, less either side)."""
    return [-abs(4 - len(_text(c))) / 10 for c in completions]


async def digits_only(completions, **kwargs):
    """An async function (awaited, as TRL awaits it): 1.0 when the answer is digits only."""
    await asyncio.sleep(0)
    return [1.0 if _text(c).strip().isdigit() else 0.0 for c in completions]


def carry_bonus(prompts, completions, answer, trainer_state, log_metric, **kwargs):
    """None where it does not apply (sums without a carry): left out, never a 0 in the baseline."""
    rewards = []
    for prompt, completion, gold in zip(prompts, completions, answer):
        a, b = (int(x) for x in _INTEGER.findall(prompt[-1]["content"])[:2])
        carries = (a % 10) + (b % 10) >= 10
        rewards.append((1.0 if _text(completion).strip() == gold else 0.0) if carries else None)
    log_metric("carry_rows", sum(r is not None for r in rewards) / len(rewards))
    return rewards
