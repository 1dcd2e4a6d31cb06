"""The sampling parameters grpod sends vLLM on every generation request (no hidden defaults).

The trainer computes temperature-scaled logprobs of the full vocabulary: plain temperature
sampling. vLLM, left to itself, fills any parameter a request leaves out from the model's
`generation_config.json` (top_k, repetition penalty, ... on many instruct models), and its
processed logprobs then include those processors: measured on SmolLM2-135M with top_k 20 and a
repetition penalty of 1.1, trainer - vLLM was -0.175 nats/token. grpod launches vLLM with
`--generation-config vllm` (vLLM's neutral defaults) and also states the neutral values on every
request it makes or translates, so a server launched otherwise still samples what the trainer
computes.
"""

from __future__ import annotations

from typing import Any

# 0 disables top-k in vLLM 0.32 (SamplingParams: "top_k must be 0 (disable), or at least 1").
NEUTRAL_SAMPLING: dict[str, Any] = {
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def with_neutral_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with every neutral parameter it does not set itself (a caller's own value wins)."""
    return {**NEUTRAL_SAMPLING, "top_p": 1.0, **body}
