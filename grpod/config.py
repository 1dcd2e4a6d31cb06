"""The typed configuration tree of grpod, loaded from TOML.

One pydantic model per component; `etc/grpod.toml` mirrors this tree key for key and documents
every knob. Every model forbids unknown keys, so a typo is an error, not a silently ignored knob.
`load_config` turns every failure (missing file, TOML syntax, unknown key, wrong type, bad value,
bad `--set` override) into one `ConfigError` whose message names the file, the key path and what
is wrong; the CLI prints it and exits with status 2.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)


class ConfigError(Exception):
    """A configuration that cannot be used; the message says where and what."""


class _Section(BaseModel):
    """Every section: unknown keys refused, values checked on assignment too (live changes), no
    infinite or NaN float anywhere (TOML's `inf` / `nan`, a JSON `1e999`), no boolean or string where
    a number is expected (pydantic would read `true` as 1 and "1" as 1), no integer beyond int64."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_number(cls, value: Any, info) -> Any:
        if isinstance(value, (int, str)) and info.field_name in _numeric_fields(cls):
            if isinstance(value, bool):
                raise ValueError(f"expected a number, not the boolean {str(value).lower()}")
            if isinstance(value, str):  # pydantic would parse "1" or "1e-5": a number is written as one
                raise ValueError(f"expected a valid number, not the string {shown(value, 40)}")
            if abs(value) > _INT64_MAX:  # a counter or size beyond any use, and beyond torch's int64
                raise ValueError(f"{value.bit_length()}-bit integer: out of range (at most {_INT64_MAX})")
        return value


_INT64_MAX = 2**63 - 1
_NUMERIC_FIELDS: dict[type, frozenset[str]] = {}


def _numeric_fields(cls: type[BaseModel]) -> frozenset[str]:
    """The fields of `cls` that hold an int or a float and no bool (computed once per class)."""
    if cls not in _NUMERIC_FIELDS:
        _NUMERIC_FIELDS[cls] = frozenset(
            name for name, field in cls.model_fields.items()
            if _holds(field.annotation, (int, float)) and not _holds(field.annotation, (bool,))
        )
    return _NUMERIC_FIELDS[cls]


def _holds(annotation: Any, types: tuple[type, ...]) -> bool:
    if annotation in types:
        return True
    return any(_holds(arg, types) for arg in get_args(annotation))


class RunConfig(_Section):
    dir: Path = Path("runs/default")
    seed: int = 0
    resume: str = "auto"  # "auto" | "never" | path of a checkpoint directory
    # A checkpoint whose model, source kind or task differs from the config is refused
    # ("refuse"), or resumed anyway with a warning ("allow").
    resume_mismatch: Literal["refuse", "allow"] = "refuse"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    progress: bool = True
    # Append every group the trainer consumes to <run.dir>/rollouts.jsonl (replayable).
    record_rollouts: bool = False


class ModelConfig(_Section):
    path: Path = Path("models/tiny-arith")
    # Build the tiny built-in model at `path` when it does not exist yet.
    init_if_missing: bool = True
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_seq_len: int = Field(256, gt=8)
    gradient_checkpointing: bool = False


class InferenceConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0 = pick a free port
    start_timeout_s: float = Field(180.0, gt=0)
    stop_grace_s: float = Field(5.0, gt=0)
    release_timeout_s: float = Field(60.0, gt=0)
    request_timeout_s: float = Field(120.0, gt=0)
    health_interval_s: float = Field(0.5, gt=0)
    # Consecutive failed /health probes before the engine is declared dead.
    health_failures: int = Field(3, ge=1)
    kv_cache_bytes: str = "64M"
    gpu_memory_utilization: float = Field(0.45, gt=0, le=1)
    enforce_eager: bool = True
    # CPU engines: "uni" runs vLLM's worker inside its EngineCore, forked from the API server (two
    # processes, one import of vLLM; OMP_NUM_THREADS = cores - 1 unless inference.env sets it);
    # "mp" is vLLM's CPU default (a Worker process of its own, pinned by VLLM_CPU_OMP_THREADS_BIND);
    # "auto" = "uni" unless the engine's cores are pinned (inference.engines > 1, cpu_binds, or
    # VLLM_CPU_OMP_THREADS_BIND in inference.env). GPU: unused.
    cpu_executor: Literal["auto", "uni", "mp"] = "auto"
    # CPU: while the trainer waits for rollouts, the engine runs on its threads plus the trainer's
    # (train.threads), given back before the step trains (grpod.inference.cores). Needs one engine
    # on this node with cpu_executor "uni" and the trainer on the CPU; "auto" = on for such an
    # engine whose model has at least 64 MiB of weights (a tiny model's engine gains nothing).
    borrow_trainer_cores: Literal["auto"] | bool = "auto"
    # API key required on every route when `host` is not a loopback address.
    api_key: str | None = None
    extra_args: list[str] = []
    env: dict[str, str] = {}
    max_restarts: int = Field(3, ge=0)
    # Engines on this node, each its own vLLM process group, port (inference.port + i when fixed),
    # log (vllm-<i>.log) and restart budget; requests go to the available one with the fewest
    # outstanding. Each engine's cores (CPU: VLLM_CPU_OMP_THREADS_BIND) or GPU
    # (CUDA_VISIBLE_DEVICES) come from cpu_binds / gpu_ids, else engine i takes core / GPU i.
    # 0: none on this node, every engine is a `grpod agent`'s (cluster.agents).
    engines: int = Field(1, ge=0)
    cpu_binds: list[str] = []
    gpu_ids: list[str] = []

    @model_validator(mode="after")
    def _one_binding_per_engine(self) -> InferenceConfig:
        for key in ("cpu_binds", "gpu_ids"):
            given = getattr(self, key)
            if given and len(given) != self.engines:
                raise ValueError(f"inference.{key} has {len(given)} entries for inference.engines = {self.engines}")
        return self


# Reward functions every dataset source knows by name (`grpod/rollouts/rewards.py` has them).
BUILTIN_REWARDS = ("math", "exact", "last_number", "regex_format")


class RewardFunctionConfig(_Section):
    """One reward function of the dataset source: a builtin name, "package.module:function", or
    "path/to/file.py:function" (a path relative to the working directory)."""

    function: str
    weight: float = 1.0
    # The name of its metric (`reward/<name>` in metrics.jsonl): default the builtin's name or the
    # function's attribute name.
    name: str | None = None
    # regex_format only: the regular expression a completion must match (re.search, DOTALL).
    pattern: str | None = None

    @field_validator("function")
    @classmethod
    def _function_spec(cls, value: str) -> str:
        if value in BUILTIN_REWARDS:
            return value
        target, _, attr = value.rpartition(":")
        if not target or not attr.isidentifier():
            raise ValueError(
                f"{value!r} is neither a builtin reward ({', '.join(BUILTIN_REWARDS)}) nor "
                "'package.module:function' / 'path/to/file.py:function'"
            )
        return value

    @model_validator(mode="after")
    def _pattern(self) -> RewardFunctionConfig:
        if self.function == "regex_format":
            if not self.pattern:
                raise ValueError("function = 'regex_format' needs pattern = \"<regular expression>\"")
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ValueError(f"pattern {self.pattern!r} is not a regular expression: {exc}") from None
        elif self.pattern is not None:
            raise ValueError(f"pattern is a key of function = 'regex_format' only, not of {self.function!r}")
        return self

    @property
    def metric_name(self) -> str:
        return self.name or self.function.rpartition(":")[2]


class DatasetConfig(_Section):
    """source.kind = "dataset": prompts from a local JSONL / Parquet / CSV file, scored by reward
    functions (`grpod/rollouts/dataset.py`, `grpod/rollouts/rewards.py`)."""

    # .jsonl / .json, .parquet or .csv (the format comes from the suffix).
    path: Path | None = None
    # A row's prompt: the string column `prompt_column`, or the chat column `messages_column`
    # (a list of {role, content}); a dataset has one of the two.
    prompt_column: str = "prompt"
    messages_column: str = "messages"
    # A system turn put before every prompt (a `messages` row that has its own keeps it).
    system_prompt: str | None = None
    shuffle_seed: int = 0
    # Passes over the dataset, each in a new shuffled order; 0 = endless (train.steps ends the run).
    epochs: int = Field(0, ge=0)
    rewards: list[RewardFunctionConfig] = []
    # A reward call running longer than this drops its group (`reward_timeout`); its worker
    # process is killed and replaced.
    reward_timeout_s: float = Field(30.0, gt=0)
    # Worker processes that run the reward functions (unset: one per core, 2 to 8).
    reward_workers: int | None = Field(None, ge=1, le=64)
    # A reward worker using more memory than this fails its call (`reward_memory`) and is replaced.
    reward_memory_mb: int = Field(2048, ge=64)
    # How several functions' rewards make a score: "sum" (weighted; TRL's sum_then_normalize) or
    # "normalize_then_sum" (each function's rewards normalised in the group first).
    reward_aggregation: Literal["sum", "normalize_then_sum"] = "sum"


class _SourceCommon(_Section):
    """What every rollout source has: the group shape, the sampling contract, the prefetch queue
    and the source alarm."""

    group_size: int = Field(8, ge=1)
    max_tokens: int = Field(16, ge=1)
    # At least 0.01: vLLM samples greedily below 1e-5 and warns of numerical errors below 0.01,
    # and the trainer divides logits by it (a tiny temperature overflows them).
    temperature: float = Field(1.0, ge=0.01)
    # Only 1.0: the trainer computes full-vocabulary logprobs, so nucleus truncation would bias
    # every importance weight (refused rather than silently off-policy).
    top_p: float = Field(1.0, gt=0, le=1)
    # Groups generated ahead of the trainer (bounded prefetch queue).
    prefetch_groups: int = Field(16, ge=1)
    concurrency: int = Field(4, ge=1)
    # Overlap generation with training (false = synchronous loop, for comparison).
    overlap: bool = True
    # A source failing without a single success for error_alarm_s raises the source alarm (console,
    # `ctl status`, Prometheus, systemd STATUS); for fail_after_s (unset: never) it ends the run, exit 1.
    error_alarm_s: float = Field(60.0, gt=0)
    fail_after_s: float | None = Field(None, gt=0)

    @field_validator("top_p")
    @classmethod
    def _full_vocabulary(cls, value: float) -> float:
        if value < 1:
            raise ValueError(
                f"source.top_p = {value} is refused: the trainer does not replicate nucleus truncation, so "
                "every importance weight would be biased; sample with top_p = 1.0"
            )
        return value


class _SamplingSourceCommon(_SourceCommon):
    """The sources that sample their groups through grpod's own vLLM (builtin, dataset)."""

    # DAPO's dynamic sampling: a group whose scores are all equal is not queued; generation goes
    # on until the step has groups with signal. After `dynamic_sampling_max_filtered` such groups
    # in a row one is let through anyway (counted), so a saturated task cannot stall a run.
    dynamic_sampling: bool = False
    dynamic_sampling_max_filtered: int = Field(256, ge=1)


class BuiltinSourceConfig(_SamplingSourceCommon):
    """source.kind = "builtin": integer arithmetic with a verifier (`grpod/rollouts/arithmetic.py`)."""

    kind: Literal["builtin"] = "builtin"
    task_seed: int = 1234
    # Builtin arithmetic prompt: "bare" (`37+45=`, exact answer: the tiny model), "instruct" (a
    # question, the last integer of the answer: a chat model), "auto" (by the tokenizer's vocabulary).
    task_prompt: Literal["auto", "bare", "instruct"] = "auto"


class DatasetSourceConfig(_SamplingSourceCommon):
    """source.kind = "dataset": your prompts and reward functions (`[source.dataset]`)."""

    kind: Literal["dataset"] = "dataset"
    dataset: DatasetConfig = DatasetConfig()

    @model_validator(mode="after")
    def _has_data_and_rewards(self) -> DatasetSourceConfig:
        if self.dataset.path is None:
            raise ValueError("source.kind = 'dataset' needs source.dataset.path (a .jsonl, .parquet or .csv file)")
        if not self.dataset.rewards:
            raise ValueError(
                "source.kind = 'dataset' needs at least one [[source.dataset.rewards]] entry "
                "(function = a builtin name or 'module:function')"
            )
        names = [r.metric_name for r in self.dataset.rewards]
        if len(set(names)) != len(names):
            raise ValueError(
                f"source.dataset.rewards: two functions share a metric name ({names}); give one a name = \"...\""
            )
        return self


class AtroposSourceConfig(_SourceCommon):
    """source.kind = "atropos": scored groups from Atropos' trajectory API (`run-api`)."""

    kind: Literal["atropos"] = "atropos"
    atropos_url: str = "http://127.0.0.1:8000"
    atropos_poll_s: float = Field(0.5, gt=0)
    # An Atropos group that declares no sampling temperature: "config" trains it at
    # source.temperature (recorded with the group, counted, warned about once), "refuse" rejects it
    # (`undeclared_temperature`). Environments should declare it: logprobs depend on it.
    atropos_undeclared_temperature: Literal["config", "refuse"] = "config"


class ReplaySourceConfig(_SourceCommon):
    """source.kind = "replay": the groups an earlier run consumed (run.record_rollouts), in order."""

    kind: Literal["replay"] = "replay"
    replay_path: Path | None = None

    @model_validator(mode="after")
    def _has_path(self) -> ReplaySourceConfig:
        if self.replay_path is None:
            raise ValueError("source.kind = 'replay' needs source.replay_path (a rollouts.jsonl)")
        return self


def _tag(default: str, key: str):
    """A discriminator that reads `key` from a raw table or a model, `default` when absent, so a
    config that names no kind/mode keeps meaning the default one."""

    def read(value: Any) -> str:
        found = value.get(key, default) if isinstance(value, dict) else getattr(value, key, default)
        return found if isinstance(found, str) else repr(found)

    return Discriminator(read)


SourceConfig = Annotated[
    Annotated[BuiltinSourceConfig, Tag("builtin")]
    | Annotated[DatasetSourceConfig, Tag("dataset")]
    | Annotated[AtroposSourceConfig, Tag("atropos")]
    | Annotated[ReplaySourceConfig, Tag("replay")],
    _tag("builtin", "kind"),
]
SOURCE_KINDS = ("builtin", "dataset", "atropos", "replay")


class LossConfig(_Section):
    """The policy loss (`grpod/training/loss.py` has the formulas).

    `type` picks the per-token objective: `grpo` and `dapo` PPO's clipped ratio (dapo = grpo with
    the token-mean aggregation, DAPO's name for it), `dr_grpo` the same objective with Dr. GRPO's
    constant normaliser and no std scaling of advantages, `cispo` the clipped, stop-gradient ratio
    times the logprob, `gspo` a sequence-level (geometric-mean) ratio clipped per sequence. A type
    chooses `aggregation` (and for dr_grpo `train.advantages.scale`) unless those keys are set.
    """

    type: Literal["grpo", "dapo", "dr_grpo", "cispo", "gspo"] = "grpo"
    # Ratio bounds 1 - clip_low .. 1 + clip_high of the PPO clip (and of CISPO's weight, GSPO's
    # sequence ratio). They bind only when a batch gets several updates (train.epochs > 1 or
    # train.minibatches > 1): with one update the ratio is exactly 1.
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    # At most 100 (typical values are 0.001 to 1): a huge coefficient overflows the loss.
    kl_coef: float = Field(0.0, ge=0, le=100)
    kl_reference: Literal["inference", "model"] = "inference"
    # Estimator of KL(pi || ref) reported and added to the loss; all three get the same, exact
    # reverse-KL gradient (the per-token coefficient logp - logp_ref clamped to +-kl_clamp).
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_clamp: float = Field(10.0, gt=0)
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    # Dr. GRPO's constant M (seq_mean_token_sum_norm): 0 = the source's completion budget
    # (source.max_tokens; for Atropos, model.max_seq_len, which grpod registers as max_token_len).
    max_completion_tokens: int = Field(0, ge=0)
    # Correction of the trainer/vLLM mismatch with the weight rho = pi_old / pi_inference:
    # token_truncate clamp(rho_t, tis_floor, cap) (tis_floor > 0 is TRL's clip_min); token_mask
    # rho_t inside [tis_floor, tis_cap], else 0;
    # sequence_* the same with the sequence's product of token ratios; icepop a two-sided token
    # mask (needs tis_floor > 0); "off" no correction (weight 1).
    tis_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop", "off"] = (
        "token_truncate"
    )
    tis_cap: float = Field(2.0, gt=0)
    tis_floor: float = Field(0.0, ge=0)
    entropy_coef: float = Field(0.0, ge=0, le=100)  # entropy bonus (0 = metric only); at most 100 like kl_coef
    mask_truncated: bool = False
    logprob_chunk_tokens: int = Field(1024, ge=1)

    @model_validator(mode="after")
    def _type_defaults(self) -> LossConfig:
        if "aggregation" not in self.model_fields_set:
            chosen = {"dr_grpo": "seq_mean_token_sum_norm", "gspo": "seq_mean_token_mean"}.get(self.type, "token_mean")
            object.__setattr__(self, "aggregation", chosen)
        if self.type == "dapo" and self.aggregation != "token_mean":
            raise ValueError("train.loss.type = 'dapo' is the token-mean aggregation; drop train.loss.aggregation")
        if self.tis_mode == "icepop" and self.tis_floor <= 0:
            raise ValueError("train.loss.tis_mode = 'icepop' is a two-sided mask: set train.loss.tis_floor > 0 (e.g. 0.5)")
        if self.tis_floor >= self.tis_cap:
            raise ValueError(f"train.loss.tis_floor ({self.tis_floor}) must be below tis_cap ({self.tis_cap})")
        return self


class AdvantageConfig(_Section):
    """How scores become advantages (`grpod/training/advantages.py` has the formulas)."""

    # grpo: centred in the group, scaled by `scale`; rloo: leave-one-out baseline (no scaling);
    # reinforce_pp: REINFORCE++, raw scores normalised over the whole step.
    estimator: Literal["grpo", "rloo", "reinforce_pp"] = "grpo"
    scale: Literal["group", "batch", "none"] = "group"
    # "sample" (Bessel, n - 1: TRL's and verl's) or "population" std for `scale`.
    std: Literal["sample", "population"] = "sample"
    drop_zero_variance: bool = True
    use_source_advantages: bool = False
    # DAPO's soft overlong punishment: a completion within `overlong_buffer` tokens of the
    # completion budget loses up to `overlong_penalty` of score, linearly (0 = off).
    overlong_buffer: int = Field(0, ge=0)
    overlong_penalty: float = Field(1.0, ge=0)


class LoraConfig(_Section):
    rank: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class TrainConfig(_Section):
    steps: int = Field(20, ge=1)
    groups_per_step: int = Field(8, ge=1)
    # At most 1: an optimizer step that moves every weight by more than 1 destroys any model.
    lr: float = Field(2e-5, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    grad_clip: float = Field(1.0, gt=0)
    optimizer: Literal["adamw", "adamw_8bit", "adafactor"] = "adamw"
    micro_batch_tokens: int = Field(4096, ge=16)
    # A micro-batch is also cut where the next (longer) sequence would bring its share of real,
    # unpadded tokens below this (0 = cut by micro_batch_tokens only).
    micro_batch_min_efficiency: float = Field(0.95, ge=0, le=1)
    # PPO epochs and minibatches: each batch is trained `epochs` times, split into `minibatches`
    # optimizer steps per epoch, against pi_old recorded before the batch's first update. With
    # 1 and 1 (one update per batch) the PPO clip cannot bind (see train.loss.clip_low).
    epochs: int = Field(1, ge=1)
    minibatches: int = Field(1, ge=1)
    # Run the training forward with dropout off (as vLLM serves the model), whatever the base
    # config's dropout says (LoRA dropout included).
    disable_dropout: bool = True
    # Alarm when |mean trainer - vLLM logprob| over the last 20 steps exceeds this (nats/token):
    # a broken sampling contract, not staleness noise (grpod/daemon/alarms.py has the figures).
    logprob_gap_alarm: float = Field(0.05, gt=0)
    # Staleness is counted in policy versions (syncs: one every bridge.sync_every optimizer
    # steps), not in optimizer steps.
    max_staleness: int = Field(4, ge=0)
    stale_policy: Literal["drop", "downweight"] = "drop"
    lora: bool = False
    device: str = "cpu"
    threads: int = Field(0, ge=0)  # torch intra-op threads for the trainer; 0 = torch default
    # Trainer ranks under torchrun (grpod/training/distributed.py): every collective of a step, a
    # sync's gather or a checkpoint waits at most this long for the other ranks.
    collective_timeout_s: float = Field(600.0, gt=0)
    loss: LossConfig = LossConfig()
    advantages: AdvantageConfig = AdvantageConfig()
    lora_config: LoraConfig = LoraConfig()

    @model_validator(mode="after")
    def _dr_grpo_scale(self) -> TrainConfig:
        # Dr. GRPO divides by no std; an explicit train.advantages.scale still wins.
        if self.loss.type == "dr_grpo" and "scale" not in self.advantages.model_fields_set:
            object.__setattr__(self.advantages, "scale", "none")
        return self


class _BridgeCommon(_Section):
    """What every weight-bridge mode has: the sync cadence and the alignment probe."""

    sync_every: int = Field(1, ge=1)
    # fp32 serving: max |vLLM - trainer| over the probe positions.
    probe_tolerance: float = Field(0.02, gt=0)
    # bf16/fp16 serving (model.dtype): rounding alone moves single tokens by ~0.2, so the mean and
    # the 95th percentile of |diff| are bounded instead (grpod/bridges/probe.py has the measurements).
    probe_low_precision_mean: float = Field(0.07, gt=0)
    probe_low_precision_p95: float = Field(0.3, gt=0)
    # Probe every N-th sync (1 = every sync); the first sync after any vLLM launch is always probed.
    probe_every: int = Field(1, ge=1)
    probe_timeout_s: float = Field(60.0, gt=0)


class NoneBridgeConfig(_BridgeCommon):
    """bridge.mode = "none": vLLM holds its own copy; a sync ships a full HF checkpoint."""

    mode: Literal["none"] = "none"
    reload: Literal["in_place", "restart"] = "in_place"


class SharedBridgeConfig(_BridgeCommon):
    """bridge.mode = "shared": one copy of the weights, read by vLLM, written by the optimizer."""

    mode: Literal["shared"] = "shared"


class LoraOnlyBridgeConfig(_BridgeCommon):
    """bridge.mode = "lora_only": vLLM serves the base once and loads each adapter version."""

    mode: Literal["lora_only"] = "lora_only"
    keep_adapters: int = Field(3, ge=1)


class LoraRestartBridgeConfig(_BridgeCommon):
    """bridge.mode = "lora_restart": vLLM relaunched on the base with each adapter version."""

    mode: Literal["lora_restart"] = "lora_restart"
    keep_adapters: int = Field(3, ge=1)


class BroadcastBridgeConfig(_BridgeCommon):
    """bridge.mode = "broadcast": trainer rank 0 sends the weights to every engine at once through
    vLLM's weight-transfer API (`grpod/bridges/broadcast.py`, `grpod/weights/transfer.py`)."""

    mode: Literal["broadcast"] = "broadcast"
    # "nccl" on GPU (vLLM's engine), "gloo" on CPU (grpod's engine, registered by its worker
    # extension); "auto" picks by where vLLM runs.
    transport: Literal["auto", "gloo", "nccl"] = "auto"
    # Where rank 0 listens for the engines' workers: 127.0.0.1 for engines on this machine, a
    # routable address of the trainer for engines on other nodes; 0 = a free port.
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    chunk_bytes: int = Field(64 * 1024 * 1024, ge=1)
    # Chunks the engines receive ahead of the one they load (double buffering).
    inflight_chunks: int = Field(2, ge=1)
    # Bounds forming the group and every collective wait, on both sides.
    timeout_s: float = Field(120.0, gt=0)


BridgeConfig = Annotated[
    Annotated[NoneBridgeConfig, Tag("none")]
    | Annotated[SharedBridgeConfig, Tag("shared")]
    | Annotated[LoraOnlyBridgeConfig, Tag("lora_only")]
    | Annotated[LoraRestartBridgeConfig, Tag("lora_restart")]
    | Annotated[BroadcastBridgeConfig, Tag("broadcast")],
    _tag("none", "mode"),
]
BRIDGE_MODES = ("none", "shared", "lora_only", "lora_restart", "broadcast")
LORA_MODES = ("lora_only", "lora_restart")


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0)  # 0 = only at `ctl checkpoint` and at shutdown
    keep_last: int = Field(3, ge=1)
    at_shutdown: bool = True


class EvalConfig(_Section):
    every: int = Field(0, ge=0)  # 0 = at start and end only
    size: int = Field(0, ge=0)  # 0 = no evaluation
    max_tokens: int = Field(8, ge=1)
    seed: int = 99
    # source.kind = "dataset": the held-out split (same columns as source.dataset.path); its first
    # `size` rows are evaluated. pass@1 (eval_accuracy) decodes greedily; mean@k (eval_mean_at_k)
    # averages the correctness of `k` samples at source.temperature (0 = not measured). A
    # completion is correct when its combined reward is >= correct_threshold. Completions get
    # max(max_tokens, source.max_tokens) tokens.
    dataset: Path | None = None
    k: int = Field(0, ge=0)
    correct_threshold: float = 1.0
    # Evaluate beside training: the step loop trains on while the engines decode the held-out
    # set, keeping the evaluated version until it ends (a sync due meanwhile waits for it).
    # false = the loop waits for each evaluation. The `shared` bridge always waits.
    overlap: bool = True


class ControlConfig(_Section):
    socket: Path | None = None  # default: <run.dir>/grpod.sock
    request_timeout_s: float = Field(600.0, gt=0)


class NotifyConfig(_Section):
    watchdog: bool = True
    # A step (or sync) running longer than this stops the heartbeat.
    stall_after_s: float = Field(600.0, gt=0)


class MetricsConfig(_Section):
    prometheus_port: int | None = None
    prometheus_host: str = "127.0.0.1"
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_mode: Literal["online", "offline"] = "online"


# A token shorter than this is refused: it guards an API that starts processes on a node.
MIN_TOKEN_CHARS = 16


def _check_token(section: str, token: str | None, token_file: Path | None) -> None:
    """What can be checked of `[section]`'s secret where it is not used: one of the two, long enough."""
    if token is not None and token_file is not None:
        raise ValueError(f"{section}.token and {section}.token_file are both set; keep one")
    if token is not None:
        _long_enough(f"{section}.token", token)


def _long_enough(key: str, token: str) -> str:
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{key}: the token has {len(token)} characters, fewer than {MIN_TOKEN_CHARS}; make one with "
            "`python -c 'import secrets; print(secrets.token_hex(16))'`"
        )
    return token


def read_token(section: str, token: str | None, token_file: Path | None) -> str | None:
    """The shared secret of `[section]`: `token`, or the first line of `token_file`, read where it is
    used (the file exists on that node only); None when neither is set. ConfigError naming the key."""
    if token_file is None:
        return token
    key = f"{section}.token_file = {str(token_file)!r}"
    try:
        return _long_enough(key, token_file.read_text().strip())
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read it: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class AgentConfig(_Section):
    """`grpod agent`: the daemon of an inference node (`grpod/agent/server.py`). It supervises this
    node's engines (`[inference]`, `[model]` of the same file) and serves them to the leader over
    an HTTP API that requires the token on every route."""

    host: str = "127.0.0.1"
    port: int = Field(7900, ge=1, le=65535)
    # Required to start an agent (one of the two); the leader's cluster.token must be the same.
    token: str | None = None
    token_file: Path | None = None
    # Engines this agent serves (default inference.engines), named engine-0, engine-1, ...
    engines: int | None = Field(None, ge=1)
    # Its log, the engines' vLLM logs and launch records (default <run.dir>/agent).
    dir: Path | None = None

    @model_validator(mode="after")
    def _token_settings(self) -> AgentConfig:
        _check_token("agent", self.token, self.token_file)
        return self

    def token_value(self) -> str | None:
        return read_token("agent", self.token, self.token_file)


class ClusterConfig(_Section):
    """Engines on other nodes: each `grpod agent` in `agents` serves `engines_per_agent` engines to
    this daemon (the leader), beside the `inference.engines` of this node."""

    # Agents' base URLs, e.g. ["http://10.0.0.2:7900"] (default port 7900).
    agents: list[str] = []
    # The agents' agent.token (one of the two is required with agents).
    token: str | None = None
    token_file: Path | None = None
    engines_per_agent: int = Field(1, ge=1)
    # Any one request to an agent but a launch (launches wait for vLLM: inference.start_timeout_s).
    request_timeout_s: float = Field(30.0, gt=0)
    # The leader watches each remote engine with a long-poll the agent answers at once when the
    # engine ends, else after this long; an agent silent for this plus request_timeout_s is
    # reported unreachable (`ctl status`), which by itself loses no engine: vLLM's /health decides.
    watch_poll_s: float = Field(30.0, gt=0, le=60)

    @field_validator("agents")
    @classmethod
    def _agent_urls(cls, urls: list[str]) -> list[str]:
        normal = []
        for i, url in enumerate(urls):
            parts = urlsplit(url)
            try:
                port = parts.port
            except ValueError:
                port = -1
            if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.path not in ("", "/"):
                raise ValueError(f"cluster.agents[{i}] = {url!r} is not an agent's base URL like 'http://10.0.0.2:7900'")
            host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            normal.append(f"{parts.scheme}://{host}:{port or 7900}")
        if len(set(normal)) != len(normal):
            raise ValueError(f"cluster.agents names one agent twice: {normal}")
        return normal

    @model_validator(mode="after")
    def _token_given(self) -> ClusterConfig:
        _check_token("cluster", self.token, self.token_file)
        if self.agents and self.token is None and self.token_file is None:
            raise ValueError("cluster.agents needs cluster.token or cluster.token_file (the agents' agent.token)")
        return self

    def token_value(self) -> str | None:
        return read_token("cluster", self.token, self.token_file)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def run_key(run_dir: Path | str) -> str:
    """A short stable name for a run directory (its resolved path, hashed): what names the run's
    resources outside it, so that a restart of the same run finds them again."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


class GrpodConfig(_Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    inference: InferenceConfig = InferenceConfig()
    source: SourceConfig = BuiltinSourceConfig()
    train: TrainConfig = TrainConfig()
    bridge: BridgeConfig = NoneBridgeConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    control: ControlConfig = ControlConfig()
    notify: NotifyConfig = NotifyConfig()
    metrics: MetricsConfig = MetricsConfig()
    agent: AgentConfig = AgentConfig()
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _modes_agree(self) -> GrpodConfig:
        if self.bridge.mode in LORA_MODES and not self.train.lora:
            raise ValueError(f"bridge.mode = {self.bridge.mode!r} needs train.lora = true")
        if self.train.lora and self.bridge.mode not in LORA_MODES:
            raise ValueError(
                f"train.lora = true needs bridge.mode 'lora_only' or 'lora_restart', not {self.bridge.mode!r}"
            )
        if self.source.kind == "dataset" and self.eval.size > 0 and self.eval.dataset is None:
            raise ValueError("eval.size > 0 with source.kind = 'dataset' needs eval.dataset (a held-out split)")
        if self.train.loss.clip_low >= 1:
            raise ValueError("train.loss.clip_low must be < 1 (the ratio floor is 1 - clip_low)")
        self._cluster_agrees()
        return self

    def _cluster_agrees(self) -> None:
        agents = self.cluster.agents
        if self.inference.engines == 0 and not agents:
            raise ValueError("inference.engines = 0 leaves no engine: list agents in cluster.agents, or set inference.engines >= 1")
        if not agents:
            return
        if self.bridge.mode != "broadcast":
            raise ValueError(
                f"cluster.agents: engines on other nodes get the weights only with bridge.mode = 'broadcast' "
                f"(got {self.bridge.mode!r}; the other modes hand vLLM paths or memory of this node)"
            )
        remote = [url for url in agents if not _is_loopback(urlsplit(url).hostname or "")]
        if remote and _is_loopback(self.bridge.host):
            raise ValueError(
                f"bridge.host = {self.bridge.host!r} is loopback, but the agents at {', '.join(remote)} must reach "
                "trainer rank 0 there: set bridge.host to an address of this node that they can reach"
            )

    @property
    def completion_budget(self) -> int:
        """The completion length M of Dr. GRPO's normaliser and of overlong shaping: the explicit
        `train.loss.max_completion_tokens`, else the source's cap (`source.max_tokens`; Atropos
        environments decide their own lengths, bounded by `model.max_seq_len`)."""
        if self.train.loss.max_completion_tokens:
            return self.train.loss.max_completion_tokens
        return self.model.max_seq_len if self.source.kind == "atropos" else self.source.max_tokens

    @property
    def socket_path(self) -> Path:
        return self.control.socket or self.run.dir / "grpod.sock"

    def digest(self) -> str:
        """A stable hash of the effective configuration, recorded in checkpoints."""
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def parse_assignment(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. train.lr=1e-5")
    key, raw = text.split("=", 1)
    path = [part for part in key.strip().split(".") if part]
    if not path:
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is taken as a string: --set bridge.mode=shared
    except (ValueError, RecursionError) as exc:  # an integer of > 4300 digits, nesting too deep
        raise ConfigError(f"--set {shown(text)}: unusable value: {str(exc)[:200]}") from None
    return path, value


def shown(value: Any, limit: int = 200) -> str:
    """`value`'s repr for a message, cut to `limit` characters (an integer too long for repr
    is described, not printed)."""
    try:
        text = repr(value)
    except ValueError:
        return f"<an integer of more than {sys.get_int_max_str_digits()} digits>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def apply_override(tree: dict[str, Any], text: str) -> None:
    """Set one `a.b.c=value` key in a raw config tree (TOML syntax for the value)."""
    path, value = parse_assignment(text)
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {text!r}: {part!r} is not a section")
        node = child
    node[path[-1]] = value


# Tags of the discriminated sections: pydantic puts them in an error's location.
_UNION_TAGS = {"source": ("kind", SOURCE_KINDS), "bridge": ("mode", BRIDGE_MODES)}


def _describe(err: ValidationError, origin: str) -> str:
    lines = []
    for item in err.errors():
        loc = [str(p) for p in item["loc"]]
        chosen = ""
        if len(loc) >= 2 and loc[0] in _UNION_TAGS and loc[1] in _UNION_TAGS[loc[0]][1]:
            key = _UNION_TAGS[loc[0]][0]
            chosen = f" of {loc[0]}.{key} = {loc[1]!r}"
            del loc[1]
        where = ".".join(loc) or "(top level)"
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            msg = f"unknown key{chosen}" if chosen else "unknown key"
        elif item["type"] == "union_tag_invalid":
            section = loc[0] if loc else "?"
            key, allowed = _UNION_TAGS.get(section, ("kind", ()))
            where = f"{section}.{key}"
            msg = f"must be one of {', '.join(repr(a) for a in allowed)} (got {item['ctx'].get('tag')})"
        elif "input" in item and item["type"] != "value_error":
            msg = f"{msg} (got {shown(item['input'])})"
        lines.append(f"{origin}: {where}: {msg}")
    return "\n".join(lines)


def parse_config(tree: dict[str, Any], origin: str = "<config>") -> GrpodConfig:
    try:
        return GrpodConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_describe(err, origin)) from None


def load_config(path: Path | str | None, overrides: list[str] = ()) -> GrpodConfig:
    """Load `path` (None = all defaults), apply `--set` overrides, validate."""
    tree: dict[str, Any] = {}
    origin = "<defaults>"
    if path is not None:
        path = Path(path)
        origin = str(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
        try:
            tree = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: TOML syntax error: {exc}") from None
        except (ValueError, RecursionError) as exc:  # an integer of > 4300 digits, nesting too deep
            raise ConfigError(f"{path}: unusable TOML: {str(exc)[:200]}") from None
    for text in overrides:
        apply_override(tree, text)
    if overrides:
        origin += " (with --set " + ", ".join(overrides) + ")"
    return parse_config(tree, origin)
