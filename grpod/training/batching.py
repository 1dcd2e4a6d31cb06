"""From kept groups to padded micro-batches: flatten, sort by length, cut by a token budget.

A micro-batch is a `[rows, max_len]` block of right-padded token ids; what it costs is
`rows x max_len` processed tokens, of which `sum(len)` are real. Sorting the step's sequences by
length before cutting keeps sequences of similar length together, so little of that block is
padding; `MicroBatchPlan.efficiency` (real / processed tokens) reports how little. The budget
`micro_batch_tokens` bounds `rows x max_len` of every micro-batch (a single sequence longer than the
budget gets a micro-batch of its own), and `micro_batch_min_efficiency` cuts a micro-batch early
where the next, longer sequence would make it mostly padding. Measured on the builtin task's mix
(bench/padding.py), the budget alone gives 74 % at 4096 tokens and needs a budget of ~512 for 95 %;
the efficiency floor of 0.95 keeps every budget at >= 95 % with 4-8 micro-batches per step.

Right padding needs no attention mask with a causal LM: a real position only attends to earlier
positions, which are all real, so its logits are those of the unpadded sequence; the pad positions'
outputs are never read. Only loss tokens are gathered out of the block (`MicroBatch.rows`,
`.positions`), so everything downstream of the forward pass is flat and padding-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from grpod.training.advantages import AdvantageResult
from grpod.training.loss import masked_for_truncation


@dataclass(frozen=True)
class TrainingSequence:
    """One completion ready to train on: its tokens, the loss mask to use, its advantage."""

    tokens: list[int]
    loss_mask: list[int]
    advantage: float
    temperature: float
    inference_logprobs: list[float] | None = None

    @property
    def loss_positions(self) -> list[int]:
        """Positions t >= 1 with loss (position 0 has no context, so no prediction to train)."""
        return [t for t in range(1, len(self.tokens)) if self.loss_mask[t]]


def training_sequences(result: AdvantageResult, *, mask_truncated: bool) -> list[TrainingSequence]:
    """Every sequence of the kept groups that has at least one loss token left.

    A per-sequence override `{"temperature": T}` (Atropos sends them) replaces the group's sampling
    temperature for that sequence: its logprobs were taken at T. A null override means "not
    overridden" (validation has already refused any other non-number).
    """
    sequences = []
    for group, advantages in zip(result.groups, result.advantages, strict=True):
        for i, tokens in enumerate(group.tokens):
            truncated = bool(group.truncated[i]) if group.truncated else False
            mask = masked_for_truncation(list(group.loss_mask[i]), truncated, mask_truncated)
            override = (group.overrides[i] or {}) if group.overrides and i < len(group.overrides) else {}
            sequence = TrainingSequence(
                tokens=list(tokens),
                loss_mask=mask,
                advantage=float(advantages[i]),
                temperature=float(_overridden(override, "temperature", group.temperature)),
                inference_logprobs=list(group.inference_logprobs[i]) if group.inference_logprobs else None,
            )
            if sequence.loss_positions:
                sequences.append(sequence)
    return sequences


def _overridden(override: dict, key: str, default: float) -> float:
    value = override.get(key)
    return default if value is None else value


@dataclass(frozen=True)
class MicroBatchPlan:
    """Micro-batches as lists of indices into the step's sequences, shortest first."""

    batches: list[list[int]]
    real_tokens: int
    processed_tokens: int

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.processed_tokens if self.processed_tokens else 1.0


def plan_micro_batches(lengths: Sequence[int], micro_batch_tokens: int, min_efficiency: float = 0.0) -> MicroBatchPlan:
    """Sort by length and cut greedily into contiguous runs.

    A micro-batch grows while `rows x max_len` fits `micro_batch_tokens` and its efficiency stays
    at least `min_efficiency`; so every micro-batch of more than one sequence meets both bounds,
    and so does the whole plan's efficiency.
    """
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    current_real = 0
    for i in order:
        # Ascending order: the newcomer is the longest, so it sets the padded width.
        padded = (len(current) + 1) * lengths[i]
        if current and (padded > micro_batch_tokens or current_real + lengths[i] < min_efficiency * padded):
            batches.append(current)
            current, current_real = [], 0
        current.append(i)
        current_real += lengths[i]
    if current:
        batches.append(current)
    processed = sum(len(batch) * lengths[batch[-1]] for batch in batches)
    return MicroBatchPlan(batches=batches, real_tokens=sum(lengths), processed_tokens=processed)


@dataclass
class MicroBatch:
    """A padded block of sequences plus the flat per-loss-token tensors the loss needs.

    Loss token k sits at `input_ids[rows[k], positions[k]]` and is predicted by the logits at
    `[rows[k], positions[k] - 1]`. `inference_logprobs[k]` is NaN where the source sent none.
    `old_logprobs` is pi_old's logprob of each loss token when the trainer recorded it before a
    batch's first update (several updates per batch), else None.
    """

    input_ids: Tensor
    rows: Tensor
    positions: Tensor
    targets: Tensor
    temperatures: Tensor
    advantages: Tensor
    inference_logprobs: Tensor
    sequence_loss_tokens: Tensor
    real_tokens: int
    # The first position whose logits predict a loss token (min(positions) - 1): the LM head
    # runs from here (`trainer.predicting_logits`); known here without reading `positions` back.
    predicted_from: int
    old_logprobs: Tensor | None = None

    @property
    def processed_tokens(self) -> int:
        return self.input_ids.numel()


def collate(
    sequences: list[TrainingSequence],
    pad_id: int,
    device: torch.device | str = "cpu",
    old_logprobs: list[Tensor] | None = None,
) -> MicroBatch:
    """Right-pad `sequences` into one block and gather their loss tokens (`old_logprobs`: one
    tensor per sequence over its loss positions, in the same order)."""
    width = max(len(s.tokens) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    rows, positions, temps, advantages, inference, counts = [], [], [], [], [], []
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq.tokens)] = torch.tensor(seq.tokens, dtype=torch.long)
        where = seq.loss_positions
        rows += [row] * len(where)
        positions += where
        temps += [seq.temperature] * len(where)
        advantages += [seq.advantage] * len(where)
        counts += [len(where)] * len(where)
        if seq.inference_logprobs is None:
            inference += [float("nan")] * len(where)
        else:
            inference += [float(seq.inference_logprobs[t]) for t in where]
    rows_t = torch.tensor(rows, dtype=torch.long)
    positions_t = torch.tensor(positions, dtype=torch.long)
    return MicroBatch(
        input_ids=input_ids.to(device),
        rows=rows_t.to(device),
        positions=positions_t.to(device),
        targets=input_ids[rows_t, positions_t].to(device),
        temperatures=torch.tensor(temps, dtype=torch.float32, device=device),
        advantages=torch.tensor(advantages, dtype=torch.float32, device=device),
        inference_logprobs=torch.tensor(inference, dtype=torch.float32, device=device),
        sequence_loss_tokens=torch.tensor(counts, dtype=torch.long, device=device),
        real_tokens=sum(len(s.tokens) for s in sequences),
        predicted_from=min(positions) - 1,
        old_logprobs=torch.cat(old_logprobs).to(device) if old_logprobs is not None else None,
    )
