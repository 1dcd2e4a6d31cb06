"""Per-token logprobs and entropies from logits, in fp32, a chunk of tokens at a time.

The contract with vLLM. vLLM runs with `--logprobs-mode processed_logprobs`, so the logprob it
reports for a sampled token is `log_softmax(logits / T)[token]` in fp32, where `T` is the request's
sampling temperature. `token_logprobs` computes exactly that quantity from the trainer's logits:
divide by the group's temperature, log-softmax in fp32, pick the target. Two things are not
replicated: vLLM's processed logprobs come after top-k / top-p filtering (with `top_p < 1` they are
logprobs of the renormalised nucleus, never below the trainer's full-vocabulary ones), and after
sampling penalties. Train with `top_p = 1` and no penalties, or accept that bias in the
importance weights. A temperature of 0 (greedy) is refused: the processed distribution is then a
point mass the trainer cannot reproduce by division.

Memory. The logits may be bf16 and `[tokens x vocab]` large (150k vocab x 4k tokens is 2.4 GB in
fp32). Neither function ever materialises an fp32 copy of all of them: the forward pass keeps only
one chunk of `chunk_tokens` rows in fp32 at a time plus one fp32 number per token, and the backward
pass of `token_logprobs` recomputes each chunk's softmax instead of saving it, writing the gradient
straight into a tensor of the logits' own dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _per_token_temperature(temperature: float | Tensor, n: int, device: torch.device) -> Tensor:
    """The sampling temperature of each of the `n` rows, as fp32; refuses T <= 0."""
    if isinstance(temperature, Tensor):
        temps = temperature.to(device=device, dtype=torch.float32).reshape(-1)
        if temps.numel() == 1:
            temps = temps.expand(n)
        if temps.numel() != n:
            raise ValueError(f"temperature has {temps.numel()} entries for {n} tokens: give one per token or one")
    else:
        temps = torch.full((n,), float(temperature), dtype=torch.float32, device=device)
    if n and not bool((temps > 0).all()):
        raise ValueError(
            f"sampling temperature must be > 0, got min {float(temps.min())}; greedy (T=0) rollouts "
            "have no logprob the trainer can reproduce, sample with T > 0"
        )
    return temps


def _check_chunk(chunk_tokens: int) -> None:
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")


class _ChunkedTokenLogprob(torch.autograd.Function):
    """`log_softmax(logits / T)[target]` with a chunk-wise recomputing backward.

    Forward saves the logits (already alive in the caller) and one fp32 log-normaliser per row.
    Backward: d logp / d logits = (onehot(target) - softmax(logits / T)) / T, one chunk at a time.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temps: Tensor, chunk_tokens: int) -> Tensor:
        n = logits.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            scaled = logits[start:end].float() / temps[start:end, None]
            lse[start:end] = torch.logsumexp(scaled, dim=-1)
            out[start:end] = scaled.gather(1, targets[start:end, None]).squeeze(1) - lse[start:end]
        ctx.save_for_backward(logits, targets, temps, lse)
        ctx.chunk_tokens = chunk_tokens
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, targets, temps, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        n = logits.shape[0]
        for start in range(0, n, ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, n)
            scale = grad_out[start:end].float() / temps[start:end]
            probs = torch.exp(logits[start:end].float() / temps[start:end, None] - lse[start:end, None])
            chunk = probs.mul_(-scale[:, None])
            chunk.scatter_add_(1, targets[start:end, None], scale[:, None])
            grad[start:end] = chunk.to(grad.dtype)
        return grad, None, None, None


def token_logprobs(
    logits: Tensor, targets: Tensor, temperature: float | Tensor = 1.0, chunk_tokens: int = 1024
) -> Tensor:
    """fp32 `log_softmax(logits / T)[target]` per token, differentiable with respect to `logits`.

    `logits` is `[tokens, vocab]` (any float dtype), `targets` `[tokens]`, `temperature` a float or
    one value per token. The result is `[tokens]` fp32. The value does not depend on `chunk_tokens`.
    """
    _check_chunk(chunk_tokens)
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"token_logprobs wants logits [tokens, vocab] and targets [tokens], got {tuple(logits.shape)} "
            f"and {tuple(targets.shape)}"
        )
    temps = _per_token_temperature(temperature, logits.shape[0], logits.device)
    return _ChunkedTokenLogprob.apply(logits, targets.long(), temps, chunk_tokens)


@torch.no_grad()
def token_entropy(logits: Tensor, temperature: float | Tensor = 1.0, chunk_tokens: int = 1024) -> Tensor:
    """fp32 entropy (nats) of `softmax(logits / T)` per token, the distribution vLLM samples from.

    No gradient: it is a diagnostic. `logits` is `[tokens, vocab]`; the result `[tokens]`.
    """
    _check_chunk(chunk_tokens)
    n = logits.shape[0]
    temps = _per_token_temperature(temperature, n, logits.device)
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    for start in range(0, n, chunk_tokens):
        end = min(start + chunk_tokens, n)
        scaled = logits[start:end].float() / temps[start:end, None]
        probs = torch.softmax(scaled, dim=-1)
        out[start:end] = -torch.special.xlogy(probs, probs).sum(dim=-1)
    return out


def token_entropy_with_grad(logits: Tensor, temperature: float | Tensor = 1.0, chunk_tokens: int = 1024) -> Tensor:
    """`token_entropy` with a gradient, for an entropy bonus (train.loss.entropy_coef > 0).

    Autograd keeps each chunk's fp32 softmax for the backward pass: [tokens x vocab] fp32 in all,
    the price of the bonus (the metric alone costs nothing extra).
    """
    _check_chunk(chunk_tokens)
    n = logits.shape[0]
    temps = _per_token_temperature(temperature, n, logits.device)
    parts = []
    for start in range(0, n, chunk_tokens):
        end = min(start + chunk_tokens, n)
        logp = torch.log_softmax(logits[start:end].float() / temps[start:end, None], dim=-1)
        parts.append(-(logp.exp() * logp).sum(dim=-1))
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)
