"""Reward functions for the arith-word example (TRL's signature, as grpod's dataset source calls them).

Named in etc/examples/smollm2-dataset.toml as "etc/examples/arith-word/rewards.py:correct".
"""

import re

_INTEGER = re.compile(r"-?\d+")


def correct(prompts, completions, completion_ids, answer, **columns):
    """1.0 when the last integer the completion writes is the answer, else 0.0."""
    rewards = []
    for completion, gold in zip(completions, answer):
        found = _INTEGER.findall(completion.replace(",", ""))
        rewards.append(1.0 if found and int(found[-1]) == int(gold) else 0.0)
    return rewards
