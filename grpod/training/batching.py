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

A group's completions share their prompt. With `train.share_prompt`, a micro-batch holds one
group's sequences packed into a single row, without padding: the prefix they share (up to the
first position whose logits are needed) once, then each sequence's rest, each at the positions it
has in its own sequence. An attention mask (`MicroBatch.attention_mask`) lets a rest attend to the
shared prefix and to its own earlier tokens only, so every logit is that of the sequence forwarded
alone. With 8 completions of a 94-token prompt and 20 to 40-token completions, that is 93 + 8 x 31
= 341 positions forwarded instead of 8 x 134 = 1072 padded, or 93 + 8 x 41 = 421 with the rests
padded to the longest.
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
    group: int = 0  # the index of its group in the batch: sequences of one group share a prompt

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
    for index, (group, advantages) in enumerate(zip(result.groups, result.advantages, strict=True)):
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
                group=index,
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
    # Prompt tokens of rows after a micro-batch's first that were not forwarded again (shared prompts).
    shared_tokens: int = 0
    # Each micro-batch is one group packed into a single row (`plan_sequences`), not a padded block.
    packed: bool = False

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.processed_tokens if self.processed_tokens else 1.0


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple` (0 or 1: `n` itself)."""
    return -(-n // multiple) * multiple if multiple > 1 else n


def plan_micro_batches(
    lengths: Sequence[int], micro_batch_tokens: int, min_efficiency: float = 0.0, pad_to_multiple: int = 0,
) -> MicroBatchPlan:
    """Sort by length and cut greedily into contiguous runs.

    A micro-batch grows while `rows x max_len` fits `micro_batch_tokens` and its efficiency stays
    at least `min_efficiency`; so every micro-batch of more than one sequence meets both bounds,
    and so does the whole plan's efficiency (before `pad_to_multiple` widens each block, which the
    plan's processed tokens count).
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
    processed = sum(len(batch) * round_up(lengths[batch[-1]], pad_to_multiple) for batch in batches)
    return MicroBatchPlan(batches=batches, real_tokens=sum(lengths), processed_tokens=processed)


# The most positions one packed micro-batch forwards. Its attention mask is dense (positions^2):
# past this a group is cut into several micro-batches, each forwarding the prompt again.
PACKED_POSITIONS = 1024


def plan_packed(
    prompts: Sequence[int], rests: Sequence[int], groups: Sequence[int], micro_batch_tokens: int, pad_to_multiple: int = 0,
) -> MicroBatchPlan:
    """Micro-batches of one group each, packed: the group's prompt (`prompts[i]`, the prefix
    sequence i shares with its group) once, then each sequence's rest (`rests[i]`), no padding
    but the rounding of each row to `pad_to_multiple` positions.
    A micro-batch grows while its positions fit `micro_batch_tokens` and `PACKED_POSITIONS`;
    a sequence whose prompt and rest exceed that gets a micro-batch of its own."""
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    budget = min(micro_batch_tokens, PACKED_POSITIONS)
    order = sorted(range(len(rests)), key=lambda i: (groups[i], rests[i]))
    batches: list[list[int]] = []
    current: list[int] = []
    positions = 0
    for i in order:
        if current and (groups[current[0]] != groups[i] or positions + rests[i] > budget):
            batches.append(current)
            current = []
        if not current:
            positions = prompts[i]
        current.append(i)
        positions += rests[i]
    if current:
        batches.append(current)
    once = [prompts[batch[0]] for batch in batches]
    processed = sum(round_up(p + sum(rests[i] for i in batch), pad_to_multiple) for p, batch in zip(once, batches, strict=True))
    return MicroBatchPlan(
        batches=batches, real_tokens=sum(rests) + sum(once), processed_tokens=processed,
        shared_tokens=sum(p * (len(batch) - 1) for p, batch in zip(once, batches, strict=True)), packed=True,
    )


def plan_sequences(
    sequences: Sequence[TrainingSequence], micro_batch_tokens: int, min_efficiency: float, share_prompt: bool,
    pad_to_multiple: int = 0,
) -> MicroBatchPlan:
    """A step's `sequences` cut into micro-batches: padded blocks (`plan_micro_batches`), or with
    `share_prompt` one group each, packed (`plan_packed`); the plan's tokens then count each
    micro-batch's prompt once, and `shared_tokens` the prompt tokens not forwarded again."""
    if not share_prompt:
        return plan_micro_batches([len(s.tokens) for s in sequences], micro_batch_tokens, min_efficiency, pad_to_multiple)
    members: dict[int, list[TrainingSequence]] = {}
    for s in sequences:
        members.setdefault(s.group, []).append(s)
    prompt = {
        group: common_prefix([s.tokens for s in rows], min(s.loss_positions[0] for s in rows) - 1)
        for group, rows in members.items()
    }
    return plan_packed([prompt[s.group] for s in sequences], [len(s.tokens) - prompt[s.group] for s in sequences],
                       [s.group for s in sequences], micro_batch_tokens, pad_to_multiple)


@dataclass
class MicroBatch:
    """A block of token ids (padded rows, or one packed row) plus the flat per-loss-token tensors
    the loss needs.

    Loss token k is sequence `rows[k]`'s token `targets[k]`, at position `positions[k]` of that
    sequence. In a padded block it sits at `input_ids[rows[k], positions[k]]` and is predicted by
    the logits at `[rows[k], positions[k] - 1]`; in a packed row (`attention_mask` set) it is
    predicted by the logits at `predict_index[k]`. `inference_logprobs[k]` is NaN where the source
    sent none. `old_logprobs` is pi_old's logprob of each loss token when the trainer recorded it
    before a batch's first update (several updates per batch), else None.
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
    # runs from here (`forward.predicting_logits`); known here without reading `positions` back.
    predicted_from: int
    old_logprobs: Tensor | None = None
    # A packed row: the leading positions every sequence has in common (0: none shared), each
    # position's place in its own sequence, the [1, 1, n, n] mask of what each position may attend
    # to (True: may), and the flat index of the logits that predict each loss token.
    shared_prefix: int = 0
    position_ids: Tensor | None = None
    attention_mask: Tensor | None = None
    predict_index: Tensor | None = None

    @property
    def processed_tokens(self) -> int:
        return self.input_ids.numel()


def collate(
    sequences: list[TrainingSequence],
    pad_id: int,
    device: torch.device | str = "cpu",
    old_logprobs: list[Tensor] | None = None,
    pack: bool = False,
    pad_to_multiple: int = 0,
) -> MicroBatch:
    """Right-pad `sequences` into one block, or with `pack` lay them out as one packed row, its
    length (a block's width, a row's positions) rounded up to `pad_to_multiple`, and gather their
    loss tokens (`old_logprobs`: one tensor per sequence over its loss positions, in the same order)."""
    rows, positions, temps, advantages, inference, counts = [], [], [], [], [], []
    for row, seq in enumerate(sequences):
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
    predicted_from = min(positions) - 1
    # A lone sequence shares no prompt: packed, it would only gain a dense [n, n] mask (775 MiB of
    # host memory at 16k positions) and lose attention's causal fast path. It goes as a padded row.
    pack = pack and len(sequences) > 1
    layout = (
        _packed(sequences, rows, positions, predicted_from, pad_id, pad_to_multiple) if pack
        else {"input_ids": _padded(sequences, pad_id, pad_to_multiple)}
    )
    return MicroBatch(
        rows=rows_t.to(device),
        positions=positions_t.to(device),
        targets=torch.tensor([sequences[r].tokens[t] for r, t in zip(rows, positions, strict=True)], dtype=torch.long, device=device),
        temperatures=torch.tensor(temps, dtype=torch.float32, device=device),
        advantages=torch.tensor(advantages, dtype=torch.float32, device=device),
        inference_logprobs=torch.tensor(inference, dtype=torch.float32, device=device),
        sequence_loss_tokens=torch.tensor(counts, dtype=torch.long, device=device),
        real_tokens=sum(len(s.tokens) for s in sequences),
        predicted_from=predicted_from,
        old_logprobs=torch.cat(old_logprobs).to(device) if old_logprobs is not None else None,
        **{key: value.to(device) if isinstance(value, Tensor) else value for key, value in layout.items()},
    )


def _padded(sequences: list[TrainingSequence], pad_id: int, pad_to_multiple: int = 0) -> Tensor:
    """`sequences` right-padded into one [rows, longest rounded up to `pad_to_multiple`] block."""
    width = round_up(max(len(s.tokens) for s in sequences), pad_to_multiple)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq.tokens)] = torch.tensor(seq.tokens, dtype=torch.long)
    return input_ids


def _packed(
    sequences: list[TrainingSequence], rows: list[int], positions: list[int], predicted_from: int, pad_id: int = 0,
    pad_to_multiple: int = 0,
) -> dict:
    """`sequences` laid out as one row: their shared prefix, then each one's rest, then pad
    positions up to a multiple of `pad_to_multiple` (the packed fields of `MicroBatch`)."""
    shared = common_prefix([s.tokens for s in sequences], predicted_from)
    ids, place, owner, starts = list(sequences[0].tokens[:shared]), list(range(shared)), [-1] * shared, []
    for row, seq in enumerate(sequences):
        starts.append(len(ids))
        ids += seq.tokens[shared:]
        place += range(shared, len(seq.tokens))
        owner += [row] * (len(seq.tokens) - shared)
    # Padding comes last and belongs to no sequence (owner -2): no real position can see it (they
    # all come earlier); it sees the shared prefix and itself, so no row of the mask is empty.
    padding = round_up(len(ids), pad_to_multiple) - len(ids)
    ids, place, owner = ids + [pad_id] * padding, place + [0] * padding, owner + [-2] * padding
    owner_t = torch.tensor(owner)
    index = torch.arange(len(ids))
    # A position sees the shared prefix and its own sequence's earlier positions (the rests are
    # laid out in order, so "earlier" is an earlier index).
    allowed = (index[None, :] <= index[:, None]) & ((owner_t[None, :] == owner_t[:, None]) | (owner_t[None, :] == -1))
    return {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "shared_prefix": shared,
        "position_ids": torch.tensor([place], dtype=torch.long),
        "attention_mask": allowed[None, None],
        # Loss token t of a sequence is predicted by its position t - 1, past the shared prefix.
        "predict_index": torch.tensor([starts[r] + t - 1 - shared for r, t in zip(rows, positions, strict=True)], dtype=torch.long),
    }


def common_prefix(rows: list[list[int]], limit: int) -> int:
    """How many leading tokens every row of `rows` (two or more) has in common, at most `limit`."""
    if len(rows) < 2:
        return 0
    first = rows[0]
    length = min(limit, *(len(r) for r in rows))
    for other in rows[1:]:
        same = 0
        while same < length and other[same] == first[same]:
            same += 1
        length = same
    return length


def minibatch_parts(n: int, parts: int, key: tuple) -> list[list[int]]:
    """`n` sequences split into `parts` (at most `n`) minibatches, shuffled by a generator seeded
    from `key`: the same key gives the same split, in this process or a resumed one."""
    parts = min(parts, n)
    if parts == 1:
        return [list(range(n))]
    generator = torch.Generator().manual_seed(hash(key) & 0x7FFFFFFF)
    order = torch.randperm(n, generator=generator).tolist()
    return [order[k::parts] for k in range(parts)]
