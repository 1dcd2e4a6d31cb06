"""One forward of the policy over a micro-batch, and what the trainer reads from it.

The trainer's step (`grpod.training.trainer`) decides what to forward and when; this module says
how a `MicroBatch` goes through a causal LM: which logits predict its loss tokens, their
logprobs at the rollouts' temperatures (the contract with vLLM, `grpod.training.logprobs`), the
frozen reference's logprobs for the KL term, and the micro-batch's share of the loss.
"""

from __future__ import annotations

import torch

from grpod.config import LossConfig
from grpod.training.batching import MicroBatch
from grpod.training.logprobs import token_entropy, token_entropy_with_grad, token_logprobs
from grpod.training.loss import LossStats, LossTokens, StepNormalizer, aggregation_weights, policy_loss


def predicting_logits(model, batch: MicroBatch) -> torch.Tensor:
    """The logits that predict `batch`'s loss tokens, one row per token. The LM head runs only
    over positions that predict a loss token (`logits_to_keep`), not over the prompts before
    them: on SmolLM2-135M the head is a fifth of a token's matmuls, and the full
    [rows, length, vocab] logits were the largest tensor of a step. A packed micro-batch (one
    group's prompt once, then its completions, `train.share_prompt`) goes through as one row with
    its attention mask, additive in the model's dtype (what eager and SDPA attention both take)."""
    if batch.attention_mask is not None:
        dtype = model.get_input_embeddings().weight.dtype
        mask = torch.zeros(batch.attention_mask.shape, dtype=dtype, device=batch.attention_mask.device)
        mask.masked_fill_(~batch.attention_mask, torch.finfo(dtype).min)
        layout = {"position_ids": batch.position_ids, "attention_mask": mask, "logits_to_keep": batch.predict_index}
        keep = batch.predict_index.numel()
    else:
        keep = batch.input_ids.shape[1] - batch.predicted_from
        layout = {"logits_to_keep": keep}
    logits = model(input_ids=batch.input_ids, use_cache=False, **layout).logits
    if logits.shape[1] != keep:
        raise RuntimeError(f"{type(model).__name__} ignored logits_to_keep: {logits.shape[1]} positions came back for {keep}")
    if batch.attention_mask is not None:
        return logits[0]
    return logits[batch.rows, batch.positions - 1 - batch.predicted_from]


@torch.no_grad()
def batch_logprobs(model, batch: MicroBatch, chunk_tokens: int) -> torch.Tensor:
    """`model`'s logprob of each of `batch`'s loss tokens, without a graph (pi_old)."""
    return token_logprobs(predicting_logits(model, batch), batch.targets, batch.temperatures, chunk_tokens)


@torch.no_grad()
def reference_logprobs(model, reference, batch: MicroBatch, loss_cfg: LossConfig) -> torch.Tensor | None:
    """The frozen reference's logprobs of `batch`'s loss tokens, for `kl_reference = "model"`:
    `reference` (full training's copy of the initial policy), or `model` with its LoRA adapters
    off when `reference` is None. None when the loss has no such KL term."""
    if loss_cfg.kl_coef <= 0 or loss_cfg.kl_reference != "model":
        return None
    if reference is not None:
        return batch_logprobs(reference, batch, loss_cfg.logprob_chunk_tokens)
    with model.disable_adapter():
        return batch_logprobs(model, batch, loss_cfg.logprob_chunk_tokens)


def micro_batch_loss(model, reference, batch: MicroBatch, normalizer: StepNormalizer,
                     loss_cfg: LossConfig) -> tuple[torch.Tensor, LossStats]:
    """Forward one micro-batch; its share of the (mini)batch loss and its statistics. Without
    `batch.old_logprobs` (one update per batch), pi_old is the policy before the update: the
    weights of this very forward."""
    chunk = loss_cfg.logprob_chunk_tokens
    predicting = predicting_logits(model, batch)
    logprobs = token_logprobs(predicting, batch.targets, batch.temperatures, chunk)
    if loss_cfg.entropy_coef > 0:
        entropy = token_entropy_with_grad(predicting, batch.temperatures, chunk)
    else:
        entropy = token_entropy(predicting.detach(), batch.temperatures, chunk)
    tokens = LossTokens(
        logprobs=logprobs,
        old_logprobs=batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach(),
        advantages=batch.advantages,
        weights=aggregation_weights(loss_cfg.aggregation, batch.sequence_loss_tokens, normalizer),
        inference_logprobs=batch.inference_logprobs,
        reference_logprobs=reference_logprobs(model, reference, batch, loss_cfg),
        entropy=entropy,
        sequence_index=batch.rows,
    )
    return policy_loss(tokens, loss_cfg)


@torch.no_grad()
def sequence_logprobs(model, token_ids: list[int], temperature: float, chunk_tokens: int,
                      device: torch.device) -> list[float]:
    """fp32 logprob of token t given tokens[:t], for t = 1..n-1 (what vLLM's prompt_logprobs
    give), in eval mode; the model's mode is restored afterwards."""
    if len(token_ids) < 2:
        raise ValueError(f"score needs at least 2 tokens to predict one, got {len(token_ids)}")
    was_training = model.training
    model.eval()
    try:
        ids = torch.tensor([token_ids], dtype=torch.long, device=device)
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        out = token_logprobs(logits, ids[0, 1:], temperature, chunk_tokens)
    finally:
        model.train(was_training)
    return out.tolist()
