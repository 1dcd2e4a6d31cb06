"""The typed configuration tree of grpod, loaded from TOML.

One pydantic model per component; `etc/grpod.toml` mirrors this tree key for key and documents
every knob. Every model forbids unknown keys, so a typo is an error, not a silently ignored knob.
`load_config` turns every failure (missing file, TOML syntax, unknown key, wrong type, bad value,
bad `--set` override) into one `ConfigError` whose message names the file, the key path and what
is wrong; the CLI prints it and exits with status 2.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(Exception):
    """A configuration that cannot be used; the message says where and what."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
    dir: Path = Path("runs/default")
    seed: int = 0
    resume: str = "auto"  # "auto" | "never" | path of a checkpoint directory
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
    # API key required on every route when `host` is not a loopback address.
    api_key: str | None = None
    extra_args: list[str] = []
    env: dict[str, str] = {}
    max_restarts: int = Field(3, ge=0)


class SourceConfig(_Section):
    kind: Literal["builtin", "atropos", "replay"] = "builtin"
    group_size: int = Field(8, ge=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    # Groups generated ahead of the trainer (bounded prefetch queue).
    prefetch_groups: int = Field(16, ge=1)
    concurrency: int = Field(4, ge=1)
    # Overlap generation with training (false = synchronous loop, for comparison).
    overlap: bool = True
    atropos_url: str = "http://127.0.0.1:8000"
    atropos_poll_s: float = Field(0.5, gt=0)
    task_seed: int = 1234
    # source.kind = "replay": a rollouts.jsonl recorded by an earlier run (run.record_rollouts).
    replay_path: Path | None = None


class LossConfig(_Section):
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    kl_coef: float = Field(0.0, ge=0)
    kl_reference: Literal["inference", "model"] = "inference"
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    tis_cap: float | None = Field(2.0, gt=0)
    mask_truncated: bool = False
    logprob_chunk_tokens: int = Field(1024, ge=1)


class AdvantageConfig(_Section):
    scale: Literal["group", "batch", "none"] = "group"
    drop_zero_variance: bool = True
    use_source_advantages: bool = False


class LoraConfig(_Section):
    rank: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class TrainConfig(_Section):
    steps: int = Field(20, ge=1)
    groups_per_step: int = Field(8, ge=1)
    lr: float = Field(2e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    grad_clip: float = Field(1.0, gt=0)
    optimizer: Literal["adamw", "adamw_8bit", "adafactor"] = "adamw"
    micro_batch_tokens: int = Field(4096, ge=16)
    # A micro-batch is also cut where the next (longer) sequence would bring its share of real,
    # unpadded tokens below this (0 = cut by micro_batch_tokens only).
    micro_batch_min_efficiency: float = Field(0.95, ge=0, le=1)
    max_staleness: int = Field(4, ge=0)
    stale_policy: Literal["drop", "downweight"] = "drop"
    lora: bool = False
    device: str = "cpu"
    threads: int = Field(0, ge=0)  # torch intra-op threads for the trainer; 0 = torch default
    loss: LossConfig = LossConfig()
    advantages: AdvantageConfig = AdvantageConfig()
    lora_config: LoraConfig = LoraConfig()


class BridgeConfig(_Section):
    mode: Literal["none", "shared", "lora_only", "lora_restart"] = "none"
    sync_every: int = Field(1, ge=1)
    reload: Literal["in_place", "restart"] = "in_place"
    probe_tolerance: float = Field(0.02, gt=0)
    # Probe every N-th sync (1 = every sync); the first sync after any vLLM launch is always probed.
    probe_every: int = Field(1, ge=1)
    probe_timeout_s: float = Field(60.0, gt=0)
    keep_adapters: int = Field(3, ge=1)


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0)  # 0 = only at `ctl checkpoint` and at shutdown
    keep_last: int = Field(3, ge=1)
    at_shutdown: bool = True


class EvalConfig(_Section):
    every: int = Field(0, ge=0)  # 0 = at start and end only
    size: int = Field(0, ge=0)  # 0 = no evaluation
    max_tokens: int = Field(8, ge=1)
    seed: int = 99


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


def run_key(run_dir: Path | str) -> str:
    """A short stable name for a run directory (its resolved path, hashed): what names the run's
    resources outside it, so that a restart of the same run finds them again."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


class GrpodConfig(_Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    inference: InferenceConfig = InferenceConfig()
    source: SourceConfig = SourceConfig()
    train: TrainConfig = TrainConfig()
    bridge: BridgeConfig = BridgeConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    control: ControlConfig = ControlConfig()
    notify: NotifyConfig = NotifyConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="after")
    def _modes_agree(self) -> GrpodConfig:
        lora_modes = {"lora_only", "lora_restart"}
        if self.bridge.mode in lora_modes and not self.train.lora:
            raise ValueError(f"bridge.mode = {self.bridge.mode!r} needs train.lora = true")
        if self.train.lora and self.bridge.mode not in lora_modes:
            raise ValueError(
                f"train.lora = true needs bridge.mode 'lora_only' or 'lora_restart', not {self.bridge.mode!r}"
            )
        if self.source.kind == "replay" and self.source.replay_path is None:
            raise ValueError("source.kind = 'replay' needs source.replay_path (a rollouts.jsonl)")
        if self.train.loss.clip_low >= 1:
            raise ValueError("train.loss.clip_low must be < 1 (the ratio floor is 1 - clip_low)")
        return self

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
    return path, value


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


def _describe(err: ValidationError, origin: str) -> str:
    lines = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            msg = "unknown key"
        elif "input" in item and item["type"] != "value_error":
            msg = f"{msg} (got {item['input']!r})"
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
        try:
            tree = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: TOML syntax error: {exc}") from None
    for text in overrides:
        apply_override(tree, text)
    if overrides:
        origin += " (with --set " + ", ".join(overrides) + ")"
    return parse_config(tree, origin)
