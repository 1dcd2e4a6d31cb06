"""The policy trainer: a HF causal LM (full fine-tuning or a peft LoRA) and the GRPO updates of a batch.

Full training loads the model in fp32 (fp32 master weights and optimizer states) on
`train.device`. LoRA loads the frozen base in `model.dtype` and trains fp32 adapters with
`train.lora_config`'s dropout (default 0, which is what vLLM applies: none). Tied input/output
embeddings stay one parameter (one optimizer state, one update), as the checkpoint stores them.
With `train.disable_dropout` (the default) every dropout of the model (LoRA's included) is set to
0 at load: training computes the function vLLM serves.

A batch's step is in phases, so that the step loop can fence each optimizer update (bridge mode
`shared`) as a line of its own:

    plan = trainer.plan(groups)              advantages, sequences, pi_old (when several updates)
    for part in trainer.parts(plan):         train.epochs x train.minibatches parts
        prepared = trainer.prepare(plan, part)   forward + loss + backward per micro-batch, clip
        trainer.apply(prepared)              optimizer step (skipped for a non-finite gradient)
    metrics = trainer.finish(plan)           schedule, counters, the batch's metrics

`train_step(groups)` runs them in order, unfenced. How a micro-batch goes through the model (the
logits that predict its loss tokens, their logprobs, its share of the loss) is
`grpod.training.forward`'s; the threads it runs on are the step loop's answer to `threads_now`
(an idle engine's cores lent to the trainer, `grpod.inference.cores`). Gradients accumulate
over a part's micro-batches; the loss normalisers are the part's (see `loss`). The learning-rate schedule
advances once per batch, trained or skipped, so it follows `train.steps` to its end.
`step` counts batches that took at least one optimizer update, `updates` the updates; a batch
with nothing to train on (every group zero-variance) or only non-finite gradients leaves the
weights and `step` untouched and reports `skipped = 1`.

Resuming: the weights come back through the constructor (`model_path` = saved full weights, or
`adapter_path` = a saved adapter over the base at `model_path`), the optimizer, schedule and step
counter through `load_state_dict`. A `train.lr`, `train.weight_decay` or other optimizer setting
(`grpod.training.optim.hyperparameters`) that differs from the checkpoint's is applied (the config
file is what a restart means) and logged. Whether the checkpoint's adapter and optimizer state fit
the config at all is asked before the trainer is built (`grpod.run.compatibility`).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from grpod.config import GrpodConfig, ModelConfig, TrainConfig
from grpod.dtypes import TORCH_DTYPES
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.signal import scored_indices
from grpod.training.advantages import compute_advantages
from grpod.training.batching import (
    MicroBatch,
    MicroBatchPlan,
    TrainingSequence,
    collate,
    minibatch_parts,
    plan_sequences,
    training_sequences,
)
from grpod.training.forward import batch_logprobs, micro_batch_loss, sequence_logprobs
from grpod.training.loss import LossStats, StepNormalizer
from grpod.training.optim import (
    apply_hyperparameters,
    build_optimizer,
    build_scheduler,
    follow_schedule,
    set_peak_lr,
)
from grpod.training.sharded import load_sharded_state

log = structlog.get_logger(__name__)

# Files a HF model directory holds besides its weights and config, which vLLM and from_pretrained
# need to load the tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)
# One of these holds the vocabulary itself.
VOCABULARY_FILES = frozenset({"tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt"})


def read_tokenizer_files(model_dir: Path) -> dict[str, bytes]:
    """The tokenizer files of a model directory, read once: every export writes them again, so an
    export never depends on the directory the run was loaded from (after a resume that is a
    checkpoint, which rotation may prune)."""
    files = {name: (model_dir / name).read_bytes() for name in TOKENIZER_FILES if (model_dir / name).is_file()}
    if not files.keys() & VOCABULARY_FILES:
        # transformers would build an empty tokenizer from the config alone: every text, no ids.
        raise FileNotFoundError(f"{model_dir}: no tokenizer vocabulary (none of {', '.join(sorted(VOCABULARY_FILES))})")
    return files


def write_tokenizer_files(files: dict[str, bytes], out: Path) -> None:
    """What `read_tokenizer_files` read, into an export directory."""
    for name, data in files.items():
        (out / name).write_bytes(data)


def _wrap_lora(base: PreTrainedModel, lcfg, adapter_path: Path | None, seed: int):
    """The base wrapped in a peft LoRA: the saved adapter at `adapter_path`, or a fresh one."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_path is not None:
        # The adapter's shape is the checkpoint's (a different one is refused before this:
        # grpod.run.compatibility); its dropout, a training setting, is the config's.
        saved = LoraConfig.from_pretrained(adapter_path)
        saved.lora_dropout = lcfg.dropout
        return PeftModel.from_pretrained(base, adapter_path, is_trainable=True, config=saved)
    peft_cfg = LoraConfig(
        r=lcfg.rank, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout,
        target_modules=list(lcfg.target_modules), bias="none", task_type="CAUSAL_LM",
    )
    # Seeded adapter init without disturbing the process RNG streams (checkpointed elsewhere).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(base, peft_cfg)


def _load_reference_model(path: Path, device: torch.device) -> PreTrainedModel:
    """The frozen reference of kl_reference = "model": the initial policy at `model.path`."""
    if not path.exists():
        raise FileNotFoundError(
            f"train.loss.kl_reference = 'model' needs the initial policy at model.path = "
            f"{path}, which does not exist; set model.path or use kl_reference = 'inference'"
        )
    reference = _load_model(path, torch.float32, device).eval()
    reference.requires_grad_(False)
    log.info("reference_model_loaded", path=str(path))
    return reference


@dataclass
class BatchPlan:
    """One batch on its way through the phases of a step (see the module docstring)."""

    groups: int
    sequences: list[TrainingSequence]
    metrics: dict[str, float]
    old: list[torch.Tensor] | None = None
    stats: LossStats = field(default_factory=LossStats)
    grad_norms: list[float] = field(default_factory=list)
    real_tokens: int = 0
    processed_tokens: int = 0
    shared_tokens: int = 0
    micro_batches: int = 0
    borrowed_micro_batches: int = 0
    started: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class PreparedUpdate:
    """Gradients of one part of a batch, accumulated and clipped; `finite` says whether
    `apply` may step on them."""

    grad_norm: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.grad_norm)


def _zero_dropout(model: torch.nn.Module) -> None:
    """Every dropout of the model to 0 (nn.Dropout layers, LoRA's included, and the attention
    dropout HF attention modules keep as a float), so training computes what vLLM serves."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def sparse_tied_embedding_gradient(model: torch.nn.Module) -> None:
    """Where the output head is the input embedding's weight (tied, as SmolLM2's) and trained,
    the lookup's gradient made sparse: the head's gradient is dense anyway, and autograd adds the
    lookup's few rows into it, where a dense lookup gradient zero-fills a vocab x hidden tensor
    and adds it in whole, each micro-batch (SmolLM2-135M: 113 MB each time; 2-3.5 % of a packed step
    on CPU, `bench/shared_prompt.py --dense-embedding`).
    The weight's gradient stays dense, as the optimizer and clipping expect. Untied embeddings
    are left alone: their gradient would be sparse."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if isinstance(embedding, torch.nn.Embedding) and head is not None and head.weight is embedding.weight:
        embedding.sparse = embedding.weight.requires_grad


def _load_model(path: Path, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.config.use_cache = False
    return model.to(device)


def load_policy(train: TrainConfig, model: ModelConfig, path: Path, device: torch.device, *,
                adapter_path: Path | None, seed: int):
    """The policy to train: the fp32 model at `path`, or (`train.lora`) its base in `model.dtype`
    under a peft LoRA (the saved adapter at `adapter_path`, or a fresh one seeded by `seed`); its
    dropout zeroed (`train.disable_dropout`), gradient checkpointing on where `model` asks."""
    if train.lora:
        policy = _wrap_lora(_load_model(path, TORCH_DTYPES[model.dtype], device), train.lora_config, adapter_path, seed)
    else:
        if adapter_path is not None:
            raise ValueError(f"adapter_path {adapter_path} given but train.lora = false")
        policy = _load_model(path, torch.float32, device)
    if train.disable_dropout:
        _zero_dropout(policy)
    if model.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return policy


class _LentThreads:
    """The torch threads of the worker thread running a phase's micro-batches: calling it sets them
    to `threads_now()` for the next micro-batch, counting those above `own` (train.threads), and
    leaving the block puts `own` back. torch's setting is per OS thread once that thread has run an
    op, so it is set in the thread that forwards, and restored before it returns to the pool."""

    def __init__(self, threads_now: Callable[[], int] | None, own: int) -> None:
        self.threads_now = threads_now if own else None
        self.own = own
        self.count = 0

    def __enter__(self) -> _LentThreads:
        return self

    def __call__(self) -> None:
        if self.threads_now is not None:
            threads = self.threads_now()
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            self.count += threads > self.own

    def __exit__(self, *exc: object) -> None:
        if self.threads_now is not None and torch.get_num_threads() != self.own:
            torch.set_num_threads(self.own)


class Trainer:
    # Whether a checkpoint needs this trainer's sharded state too (`DistributedTrainer`).
    sharded = False

    def __init__(
        self,
        train: TrainConfig,
        model: ModelConfig,
        *,
        model_path: Path | None = None,
        adapter_path: Path | None = None,
        seed: int = 0,
        completion_budget: int,
    ) -> None:
        """`train` and `model` are the config's sections; `model_path` the weights to load (default
        `model.path`; a resumed checkpoint's otherwise); `completion_budget` the completion length M
        of Dr. GRPO's normaliser and of overlong shaping (`GrpodConfig.completion_budget`)."""
        self.train_cfg = train
        self.model_cfg = model
        self.seed = seed
        self.completion_budget = completion_budget
        self.model_path = Path(model_path or model.path)
        self.device = torch.device(train.device)
        if train.threads:
            torch.set_num_threads(train.threads)
        self.tokenizer_files = read_tokenizer_files(self.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = load_policy(train, model, self.model_path, self.device, adapter_path=adapter_path, seed=seed)
        # FSDP2 ranks shard the embedding: its gradient stays dense there.
        if not self.sharded:
            sparse_tied_embedding_gradient(self.model)

        # The frozen reference for kl_reference = "model" is the initial policy, `model.path` (not
        # `model_path`, which is the resumed weights after a restart); LoRA has it for free
        # (the base with adapters off), full training holds a second copy, loaded the first time
        # a step needs it (kl_coef may be turned on live).
        self.reference_model: PreTrainedModel | None = None
        if self._needs_reference():
            self._load_reference()

        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.trainable, train)
        self.scheduler = build_scheduler(self.optimizer, train)
        self.step = 0
        self.updates = 0
        # Before each micro-batch, the threads it may run on (None: train.threads throughout); the
        # step loop lends the trainer idle engines' cores through it (grpod.inference.cores).
        self.threads_now: Callable[[], int] | None = None
        self.vocab_size: int = self.model.config.vocab_size
        pad = self.tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        log.info(
            "trainer_loaded", model=str(self.model_path), lora=train.lora, device=str(self.device),
            trainable_params=sum(p.numel() for p in self.trainable), optimizer=train.optimizer,
        )

    def _needs_reference(self) -> bool:
        loss_cfg = self.train_cfg.loss
        return loss_cfg.kl_coef > 0 and loss_cfg.kl_reference == "model" and not self.train_cfg.lora

    def _load_reference(self) -> None:
        self.reference_model = _load_reference_model(self.model_cfg.path, self.device)

    def _forward_mode(self) -> None:
        """Train mode (gradient checkpointing only acts in it), with dropout zeroed at load time
        when `train.disable_dropout`."""
        self.model.train()

    def plan(self, groups: list[RolloutGroup]) -> BatchPlan:
        """Advantages, training sequences and (several updates) pi_old of a batch."""
        cfg = self.train_cfg
        scores = [g.scores[i] for g in groups for i in scored_indices(g)]  # not unscorable placeholders
        advantages = compute_advantages(groups, cfg.advantages, self.completion_budget)
        sequences = training_sequences(advantages, mask_truncated=cfg.loss.mask_truncated)
        plan = BatchPlan(
            groups=len(groups),
            sequences=sequences,
            metrics={
                "reward_mean": sum(scores) / len(scores) if scores else float("nan"),
                "dropped_zero_variance": float(advantages.dropped_zero_variance),
                "overlong_penalized": float(advantages.overlong_penalized),
                "sequences": float(len(sequences)),
                # Completion tokens whose advantage is not zero: the generation that reached a gradient.
                "gradient_tokens": float(sum(len(s.loss_positions) for s in sequences if s.advantage != 0.0)),
                # The rate this batch's updates use (the scheduler's cached one lags a `ctl set train.lr`).
                "lr": self.optimizer.param_groups[0]["lr"],
            },
        )
        if not sequences:
            return plan
        if self.reference_model is None and self._needs_reference():
            self._load_reference()
        self._forward_mode()
        if cfg.epochs * cfg.minibatches > 1:
            plan.old = self._old_logprobs(sequences)
        return plan

    def parts(self, plan: BatchPlan) -> Iterator[list[int]]:
        """The parts of the batch, one optimizer update each: `train.minibatches` per epoch."""
        if not plan.sequences:
            return
        for epoch in range(self.train_cfg.epochs):
            yield from self._minibatches(len(plan.sequences), epoch)

    def prepare(self, plan: BatchPlan, part: list[int]) -> PreparedUpdate:
        """Forward, loss and backward of each micro-batch of `part`, then the gradient clip."""
        normalizer = StepNormalizer.for_step([len(plan.sequences[i].loss_positions) for i in part], self.completion_budget)
        self.optimizer.zero_grad(set_to_none=True)
        self._backward(plan, part, normalizer)
        grad_norm = self._clip_gradients(self.train_cfg.grad_clip)
        plan.grad_norms.append(grad_norm)
        prepared = PreparedUpdate(grad_norm)
        if not prepared.finite:
            self.optimizer.zero_grad(set_to_none=True)
            log.warning("update_skipped", reason="non_finite_grad_norm", grad_norm=grad_norm, step=self.step)
        return prepared

    def _backward(self, plan: BatchPlan, part: list[int], normalizer: StepNormalizer) -> None:
        """The micro-batches of `part`, one after the other (gradients accumulate)."""
        micro = self._micro_plan([plan.sequences[i] for i in part])
        with _LentThreads(self.threads_now, self.train_cfg.threads) as borrowed:
            for indices in micro.batches:
                borrowed()
                plan.stats.merge(self._micro_batch_backward(plan, [part[i] for i in indices], normalizer, micro.packed))
        plan.borrowed_micro_batches += borrowed.count
        plan.real_tokens += micro.real_tokens
        plan.processed_tokens += micro.processed_tokens
        plan.shared_tokens += micro.shared_tokens
        plan.micro_batches += len(micro.batches)

    def _micro_batch_backward(self, plan: BatchPlan, rows: list[int], normalizer: StepNormalizer, pack: bool = False) -> LossStats:
        """Forward the plan's sequences `rows` as one micro-batch, its share of the loss, backward."""
        old = [plan.old[i] for i in rows] if plan.old is not None else None
        batch = self._collate([plan.sequences[i] for i in rows], pack, old)
        loss, stats = self._micro_batch_loss(batch, normalizer)
        loss.backward()
        return stats

    @property
    def packs_groups(self) -> bool:
        """Whether a group's prompt is forwarded once, its completions packed after it in one row
        (`train.share_prompt`): only where the model's attention takes a custom mask (eager, SDPA;
        not flash-attention kernels), and not on FSDP2 ranks, which deal a batch out by sequence, not
        by group (`grpod.training.distributed`)."""
        attention = getattr(self.model.config, "_attn_implementation", None)
        return self.train_cfg.share_prompt and not self.sharded and attention in ("eager", "sdpa")

    def _micro_plan(self, sequences: list[TrainingSequence]) -> MicroBatchPlan:
        c = self.train_cfg
        return plan_sequences(sequences, c.micro_batch_tokens, c.micro_batch_min_efficiency, self.packs_groups, c.pad_to_multiple)

    def _collate(self, sequences: list[TrainingSequence], pack: bool, old: list[torch.Tensor] | None = None) -> MicroBatch:
        return collate(sequences, self.pad_id, self.device, old, pack, self.train_cfg.pad_to_multiple)

    def _clip_gradients(self, max_norm: float) -> float:
        """Clip the gradient to `max_norm`; its norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(self.trainable, max_norm))

    def apply(self, prepared: PreparedUpdate) -> None:
        """The optimizer step on prepared gradients: the only place the weights change."""
        if not prepared.finite:
            raise ValueError(f"apply() of a non-finite gradient (norm {prepared.grad_norm})")
        self.optimizer.step()
        self.updates += 1
        self.optimizer.zero_grad(set_to_none=True)

    def finish(self, plan: BatchPlan) -> dict[str, float]:
        """Advance the schedule, count the step, and return the batch's metrics."""
        self._advance_schedule()
        metrics = plan.metrics
        if not plan.sequences:
            log.info("train_step_skipped", reason="no_trainable_sequences", groups=plan.groups, **metrics)
            return metrics | {"skipped": 1.0, "optimizer_steps": float(self.updates)}
        finite = [g for g in plan.grad_norms if math.isfinite(g)]
        if not finite:
            log.warning("train_step_skipped", reason="non_finite_grad_norm", grad_norm=plan.grad_norms[-1], step=self.step)
            return metrics | {"skipped": 1.0, "grad_norm": plan.grad_norms[-1], "optimizer_steps": float(self.updates)}
        self.step += 1
        metrics |= plan.stats.as_metrics()
        metrics |= {
            "optimizer_steps": float(self.updates),
            "updates": float(len(finite)),
            "skipped": 0.0,
            "grad_norm": sum(finite) / len(finite),
            # The batch's tokens; processed_tokens are the positions forwarded, padding included
            # and a group's shared prompt once per micro-batch (shared_prompt_tokens: not forwarded again).
            "tokens": float(plan.real_tokens + plan.shared_tokens),
            "processed_tokens": float(plan.processed_tokens),
            "shared_prompt_tokens": float(plan.shared_tokens),
            "padding_efficiency": plan.real_tokens / plan.processed_tokens if plan.processed_tokens else 1.0,
            "micro_batches": float(plan.micro_batches),
            "borrowed_core_micro_batches": float(plan.borrowed_micro_batches),
            "step_time_s": time.perf_counter() - plan.started,
        }
        log.debug("train_step", **metrics)
        return metrics

    def train_step(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """The updates of one batch, `groups`, unfenced; returns its metrics (module docstring)."""
        plan = self.plan(groups)
        for part in self.parts(plan):
            prepared = self.prepare(plan, part)
            if prepared.finite:
                self.apply(prepared)
        return self.finish(plan)

    def _advance_schedule(self) -> None:
        """One schedule step per batch (F12 of the audit: a skipped batch used to leave the cosine
        behind `train.steps`). torch warns when this precedes any optimizer step; here that is
        meant: the schedule counts batches, not updates."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.scheduler.step()

    def _minibatches(self, n: int, epoch: int) -> list[list[int]]:
        """`train.minibatches` parts, shuffled by (run seed, batch index, epoch): a resumed run
        splits the same way."""
        return minibatch_parts(n, self.train_cfg.minibatches, (self.seed, self.scheduler.last_epoch, epoch))

    @torch.no_grad()
    def _old_logprobs(self, sequences: list[TrainingSequence]) -> list[torch.Tensor]:
        """pi_old's logprob of every loss token, per sequence, before the batch's first update."""
        plan = self._micro_plan(sequences)
        old: list[torch.Tensor | None] = [None] * len(sequences)
        with _LentThreads(self.threads_now, self.train_cfg.threads) as borrowed:
            for indices in plan.batches:
                borrowed()
                for i, logprobs in self._micro_batch_logprobs(sequences, indices, plan.packed).items():
                    old[i] = logprobs
        return old

    def _micro_batch_logprobs(self, sequences: list[TrainingSequence], indices: list[int], pack: bool = False) -> dict[int, torch.Tensor]:
        """Each of `sequences[indices]`'s loss-token logprobs, forwarded as one micro-batch."""
        batch = self._collate([sequences[i] for i in indices], pack)
        logprobs = batch_logprobs(self.model, batch, self.train_cfg.loss.logprob_chunk_tokens)
        return {i: logprobs[batch.rows == row] for row, i in enumerate(indices)}

    def _micro_batch_loss(self, batch: MicroBatch, normalizer: StepNormalizer) -> tuple[torch.Tensor, LossStats]:
        """Forward one micro-batch; its share of the (mini)batch loss and its statistics."""
        return micro_batch_loss(self.model, self.reference_model, batch, normalizer, self.train_cfg.loss)

    def score(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        """fp32 logprob of token t given tokens[:t], for t = 1..n-1 (what vLLM's prompt_logprobs give)."""
        return sequence_logprobs(self.model, token_ids, temperature, self.train_cfg.loss.logprob_chunk_tokens, self.device)

    def save_weights(self, out: Path) -> None:
        """Write what vLLM loads: the full model as HF safetensors (with the tokenizer files), or
        the peft adapter (adapter_config.json + adapter_model.safetensors) for LoRA.

        Not atomic by itself: callers write into a fresh directory and publish it when this returns.
        """
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        if not self.train_cfg.lora:
            write_tokenizer_files(self.tokenizer_files, out)
        log.info("weights_saved", out=str(out), lora=self.train_cfg.lora, step=self.step)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the whole model's tensors on the CPU (what a bridge ships to the engines while
        training goes on)."""
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.model.state_dict().items()}

    def set_learning_rate(self, lr: float) -> None:
        """Change the peak learning rate live; the schedule's shape (warm-up, cosine) is kept."""
        set_peak_lr(self.optimizer, self.scheduler, lr)
        log.info("learning_rate_set", lr=lr, step=self.step)

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, schedule and step counter (weights are saved by `save_weights`).

        The optimizer's state tensors are the live ones, not copies (a copy would double the
        optimizer's memory): serialise the result before the next `train_step`.
        """
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """What `state_dict` returned, without "optimizer" when it came from `load_sharded` or starts
        afresh (resume_mismatch = "allow"); the config's optimizer settings win, each change logged."""
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        follow_schedule(self.optimizer, self.scheduler)
        self.step = int(state["step"])
        self.updates = int(state.get("updates", self.step))
        for key, old, new in apply_hyperparameters(self.optimizer, self.train_cfg):
            setting = f"train.{key}" if key in TrainConfig.model_fields else f"{self.train_cfg.optimizer} {key}"
            log.warning("optimizer_setting_from_config", key=setting, checkpoint=old, config=new)
        saved_lr = self.scheduler.base_lrs[0]
        if not math.isclose(saved_lr, self.train_cfg.lr, rel_tol=1e-9):
            log.warning("learning_rate_from_config", checkpoint_lr=saved_lr, config_lr=self.train_cfg.lr)
            self.set_learning_rate(self.train_cfg.lr)

    def load_sharded(self, path: Path, with_optimizer: bool = True) -> None:
        """Weights and (unless not `with_optimizer`) optimizer state from the sharded checkpoint of
        trainer ranks under torchrun (`grpod.training.sharded`), gathered into this one process."""
        load_sharded_state(self.model, self.optimizer if with_optimizer else None, path)


def build_trainer(cfg: GrpodConfig, model_path: Path | None = None, *, adapter_path: Path | None = None) -> Trainer:
    """The trainer a run's config describes: its `train` and `model` sections, the run's seed and
    the completion budget, on `model_path` (default `model.path`)."""
    return Trainer(
        cfg.train, cfg.model, model_path=model_path, adapter_path=adapter_path,
        seed=cfg.run.seed, completion_budget=cfg.completion_budget,
    )
