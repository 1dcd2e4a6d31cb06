"""The policy trainer: a HF causal LM (full fine-tuning or a peft LoRA) and one GRPO step per batch.

Full training loads the model in fp32 (fp32 master weights and optimizer states) on
`train.device`. LoRA loads the frozen base in `model.dtype` and trains fp32 adapters with
`train.lora_config`'s dropout (default 0, which is what vLLM applies: none). Tied input/output
embeddings stay one parameter (one optimizer state, one update), as the checkpoint stores them.

`train_step` is the whole step, top to bottom: advantages, micro-batches, forward + loss + backward
per micro-batch (gradients accumulate; the loss normalisers are the step's, see `loss`), clip,
optimizer step, schedule step. `step` counts optimizer steps taken: a batch with nothing to train
on (every group zero-variance) or a non-finite gradient leaves the weights, the schedule and `step`
untouched and reports `skipped = 1`.

Resuming: the weights come back through the constructor (`model_path` = saved full weights, or
`adapter_path` = a saved adapter over the base at `model_path`), the optimizer, schedule and step
counter through `load_state_dict`.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from grpod.config import GrpodConfig
from grpod.rollouts.group import RolloutGroup
from grpod.training.advantages import compute_advantages
from grpod.training.batching import MicroBatch, collate, plan_micro_batches, training_sequences
from grpod.training.logprobs import token_entropy, token_logprobs
from grpod.training.loss import LossStats, LossTokens, StepNormalizer, aggregation_weights, policy_loss
from grpod.training.optim import build_optimizer, build_scheduler

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files a HF model directory holds besides its weights and config, which vLLM and from_pretrained
# need to load the tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)


def _run_unfenced(update: Callable[[], object]) -> object:
    return update()


def _load_model(path: Path, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.config.use_cache = False
    return model.to(device)


class Trainer:
    def __init__(self, cfg: GrpodConfig, model_path: Path, *, adapter_path: Path | None = None) -> None:
        self.cfg = cfg
        self.model_path = Path(model_path)
        self.device = torch.device(cfg.train.device)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)

        if cfg.train.lora:
            base = _load_model(self.model_path, DTYPES[cfg.model.dtype], self.device)
            self.model = self._wrap_lora(base, adapter_path)
        else:
            if adapter_path is not None:
                raise ValueError(f"adapter_path {adapter_path} given but train.lora = false")
            self.model = _load_model(self.model_path, torch.float32, self.device)
        if cfg.model.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        # The frozen reference for kl_reference = "model" is the initial policy, `model.path` (not
        # `model_path`, which is the resumed weights after a restart); LoRA has it for free
        # (the base with adapters off), full training holds a second copy.
        self.reference_model: PreTrainedModel | None = None
        loss_cfg = cfg.train.loss
        if loss_cfg.kl_coef > 0 and loss_cfg.kl_reference == "model" and not cfg.train.lora:
            if not cfg.model.path.exists():
                raise FileNotFoundError(
                    f"train.loss.kl_reference = 'model' needs the initial policy at model.path = "
                    f"{cfg.model.path}, which does not exist; set model.path or use kl_reference = 'inference'"
                )
            self.reference_model = _load_model(cfg.model.path, torch.float32, self.device).eval()
            self.reference_model.requires_grad_(False)

        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.trainable, cfg.train)
        # Every optimizer step (the only place the weights change) runs as `update_fence(step)`.
        # A bridge whose vLLM reads these parameters in place (`shared`) sets a fence that pauses
        # generation around the step; train_step must then run in an anyio worker thread.
        self.update_fence: Callable[[Callable[[], object]], object] = _run_unfenced
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.step = 0
        self.vocab_size: int = self.model.config.vocab_size
        pad = self.tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        log.info(
            "trainer_loaded", model=str(self.model_path), lora=cfg.train.lora, device=str(self.device),
            trainable_params=sum(p.numel() for p in self.trainable), optimizer=cfg.train.optimizer,
        )

    def _wrap_lora(self, base: PreTrainedModel, adapter_path: Path | None):
        from peft import LoraConfig, PeftModel, get_peft_model

        if adapter_path is not None:
            return PeftModel.from_pretrained(base, adapter_path, is_trainable=True)
        lcfg = self.cfg.train.lora_config
        peft_cfg = LoraConfig(
            r=lcfg.rank, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout,
            target_modules=list(lcfg.target_modules), bias="none", task_type="CAUSAL_LM",
        )
        # Seeded adapter init without disturbing the process RNG streams (checkpointed elsewhere).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.run.seed)
            return get_peft_model(base, peft_cfg)

    def train_step(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """One optimizer step on `groups`; returns its metrics (see the module docstring)."""
        started = time.perf_counter()
        cfg = self.cfg.train
        scores = [s for g in groups for s in g.scores]
        advantages = compute_advantages(groups, cfg.advantages)
        sequences = training_sequences(advantages, mask_truncated=cfg.loss.mask_truncated)
        metrics: dict[str, float] = {
            "reward_mean": sum(scores) / len(scores) if scores else float("nan"),
            "dropped_zero_variance": float(advantages.dropped_zero_variance),
            "sequences": float(len(sequences)),
            "lr": self.scheduler.get_last_lr()[0],
        }
        if not sequences:
            log.info("train_step_skipped", reason="no_trainable_sequences", groups=len(groups), **metrics)
            return metrics | {"skipped": 1.0, "optimizer_steps": float(self.step)}

        plan = plan_micro_batches(
            [len(s.tokens) for s in sequences], cfg.micro_batch_tokens, cfg.micro_batch_min_efficiency
        )
        normalizer = StepNormalizer.for_step([len(s.loss_positions) for s in sequences], self.cfg.source.max_tokens)

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        stats = LossStats()
        for indices in plan.batches:
            batch = collate([sequences[i] for i in indices], self.pad_id, self.device)
            loss, batch_stats = self._micro_batch_loss(batch, normalizer)
            loss.backward()
            stats.merge(batch_stats)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, cfg.grad_clip))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            log.warning("train_step_skipped", reason="non_finite_grad_norm", grad_norm=grad_norm, step=self.step)
            return metrics | {"skipped": 1.0, "grad_norm": grad_norm, "optimizer_steps": float(self.step)}
        self.update_fence(self.optimizer.step)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

        metrics |= stats.as_metrics()
        metrics |= {
            "optimizer_steps": float(self.step),
            "skipped": 0.0,
            "grad_norm": grad_norm,
            "tokens": float(plan.real_tokens),
            "processed_tokens": float(plan.processed_tokens),
            "padding_efficiency": plan.efficiency,
            "micro_batches": float(len(plan.batches)),
            "step_time_s": time.perf_counter() - started,
        }
        log.debug("train_step", **metrics)
        return metrics

    def _micro_batch_loss(self, batch: MicroBatch, normalizer: StepNormalizer) -> tuple[torch.Tensor, LossStats]:
        """Forward one micro-batch; its share of the step loss and its statistics."""
        loss_cfg = self.cfg.train.loss
        chunk = loss_cfg.logprob_chunk_tokens
        logits = self.model(input_ids=batch.input_ids, use_cache=False).logits
        predicting = logits[batch.rows, batch.positions - 1]
        logprobs = token_logprobs(predicting, batch.targets, batch.temperatures, chunk)
        tokens = LossTokens(
            logprobs=logprobs,
            old_logprobs=logprobs.detach(),  # one optimizer step per batch: pi_old = pi before it
            advantages=batch.advantages,
            weights=aggregation_weights(loss_cfg.aggregation, batch.sequence_loss_tokens, normalizer),
            inference_logprobs=batch.inference_logprobs,
            reference_logprobs=self._reference_logprobs(batch),
            entropy=token_entropy(predicting.detach(), batch.temperatures, chunk),
        )
        return policy_loss(tokens, loss_cfg)

    @torch.no_grad()
    def _reference_logprobs(self, batch: MicroBatch) -> torch.Tensor | None:
        loss_cfg = self.cfg.train.loss
        if loss_cfg.kl_coef <= 0 or loss_cfg.kl_reference != "model":
            return None
        if self.reference_model is not None:
            logits = self.reference_model(input_ids=batch.input_ids, use_cache=False).logits
        else:
            with self.model.disable_adapter():
                logits = self.model(input_ids=batch.input_ids, use_cache=False).logits
        predicting = logits[batch.rows, batch.positions - 1]
        return token_logprobs(predicting, batch.targets, batch.temperatures, loss_cfg.logprob_chunk_tokens)

    @torch.no_grad()
    def score(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        """fp32 logprob of token t given tokens[:t], for t = 1..n-1 (what vLLM's prompt_logprobs give)."""
        if len(token_ids) < 2:
            raise ValueError(f"score needs at least 2 tokens to predict one, got {len(token_ids)}")
        was_training = self.model.training
        self.model.eval()
        try:
            ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1]
            out = token_logprobs(logits, ids[0, 1:], temperature, self.cfg.train.loss.logprob_chunk_tokens)
        finally:
            self.model.train(was_training)
        return out.tolist()

    def save_weights(self, out: Path) -> None:
        """Write what vLLM loads: the full model as HF safetensors (with the tokenizer files), or
        the peft adapter (adapter_config.json + adapter_model.safetensors) for LoRA.

        Not atomic by itself: callers write into a fresh directory and publish it when this returns.
        """
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        if not self.cfg.train.lora:
            for name in TOKENIZER_FILES:
                source = self.model_path / name
                if source.is_file():
                    shutil.copy2(source, out / name)
        log.info("weights_saved", out=str(out), lora=self.cfg.train.lora, step=self.step)

    def set_learning_rate(self, lr: float) -> None:
        """Change the peak learning rate live; the schedule's shape (warm-up, cosine) is kept."""
        scale = lr / self.scheduler.base_lrs[0]
        self.scheduler.base_lrs = [base * scale for base in self.scheduler.base_lrs]
        for group in self.optimizer.param_groups:
            group["lr"] *= scale
            group["initial_lr"] = group.get("initial_lr", lr) * scale
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
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
