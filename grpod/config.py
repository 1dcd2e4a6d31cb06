"""The typed configuration tree of grpod, loaded from TOML.

One pydantic model per component. Every knob is documented once, by its `Field(description=...)`
here: `etc/grpod.toml` (the embedded default, mirroring this tree key for key) and
`docs/configuration.md` are generated from those descriptions (`python -m grpod.config_docs`).
Every model forbids unknown keys, so a typo is an error, not a silently ignored knob.
`load_config` turns every failure (missing file, TOML syntax, unknown key, wrong type, bad value,
bad `--set` override) into one `ConfigError` whose message names the file, the key path and what
is wrong; the CLI prints it and exits with status 2.
"""

from __future__ import annotations

import copy
import hashlib
import ipaddress
import json
import os
import re
import stat
import sys
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
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
    a number is expected (pydantic would read `true` as 1 and "1" as 1), no integer beyond int64.
    A number where text is expected is taken as its text: `--set inference.env.OMP_NUM_THREADS=2`,
    `--set inference.kv_cache_bytes=64000000` (TOML reads both as integers)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, coerce_numbers_to_str=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_number(cls, value: Any, info) -> Any:
        if isinstance(value, (int, str)) and info.field_name in _numeric_fields(cls):
            if isinstance(value, bool):
                raise ValueError(f"expected a number, not the boolean {str(value).lower()}")
            if isinstance(value, str):
                if value in _words(cls.model_fields[info.field_name].annotation):
                    return value  # a word the field takes beside its number ("auto")
                # pydantic would parse "1" or "1e-5": a number is written as one
                raise ValueError(f"expected a valid number, not the string {shown(value, 40)}")
            if abs(value) > _INT64_MAX:  # a counter or size beyond any use, and beyond torch's int64
                raise ValueError(f"{value.bit_length()}-bit integer: out of range (at most {_INT64_MAX})")
        return value


_INT64_MAX = 2**63 - 1
UNIX_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path is 108 with its NUL)
_NUMERIC_FIELDS: dict[type, frozenset[str]] = {}


def _numeric_fields(cls: type[BaseModel]) -> frozenset[str]:
    """The fields of `cls` that hold an int or a float and no bool (computed once per class)."""
    if cls not in _NUMERIC_FIELDS:
        _NUMERIC_FIELDS[cls] = frozenset(
            name for name, field in cls.model_fields.items()
            if _holds(field.annotation, (int, float)) and not _holds(field.annotation, (bool,))
        )
    return _NUMERIC_FIELDS[cls]


def _words(annotation: Any) -> set[str]:
    """The strings a field takes beside its number (`Literal["auto"] | int`: {"auto"})."""
    if get_origin(annotation) is Literal:
        return {arg for arg in get_args(annotation) if isinstance(arg, str)}
    return set().union(*(_words(arg) for arg in get_args(annotation)))


def _holds(annotation: Any, types: tuple[type, ...]) -> bool:
    if annotation in types:
        return True
    return any(_holds(arg, types) for arg in get_args(annotation))


def _named_path(value: Any) -> Any:
    if isinstance(value, str) and not value.strip():  # Path("") is the current directory
        raise ValueError("an empty path: name one (or leave the key out for its default)")
    return value


# A path that is never "" (which would silently mean the current directory).
NamedPath = Annotated[Path, BeforeValidator(_named_path)]


class RunConfig(_Section):
    dir: NamedPath = Field(
        Path("runs/default"),
        description="Run directory (created mode 0700): the JSON log, metrics, checkpoints, vLLM logs and the "
        "control socket.",
    )
    seed: int = Field(0, description="Seed of the trainer (and of the tiny built-in model when grpod builds it).")
    resume: str = Field(
        "auto",
        description='"auto": resume from the newest complete checkpoint in run.dir; "never": start afresh; or the '
        "path of a checkpoint directory, applied once (later starts resume what was trained since). \"never\" and a "
        "path move the run directory's newer checkpoints to superseded/.",
    )
    resume_mismatch: Literal["refuse", "allow"] = Field(
        "refuse",
        description="A checkpoint whose model, source kind or task differs from the config: \"refuse\" (exit 2, "
        "both named) or \"allow\" (resumed anyway, with a warning). Likewise a checkpoint of another "
        "train.optimizer (\"allow\": its optimizer state is dropped and the optimizer starts afresh); one whose "
        "LoRA settings differ (train.lora, rank, alpha, target modules) is refused either way.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Console level; the JSON log (<run.dir>/grpod.log) always has everything."
    )
    log_max_mb: float = Field(
        256.0, ge=0, description="Each log file in run.dir (grpod.log, the engines' vllm*.log, rewards.log, the "
        "environments' logs) is cut to its last lines (half of this, at most 16 MiB) when it grows past this many MiB, "
        "checked every 10 s, with a line at its head saying so: output printed by a reward function or an "
        "environment cannot fill the disk. metrics.jsonl and rollouts.jsonl are never cut. 0: never cut.",
    )
    progress: bool = Field(True, description="One progress line per step on the console.")
    record_rollouts: bool = Field(
        False,
        description="Append every group the trainer consumes to <run.dir>/rollouts.jsonl (replayable with "
        'source.kind = "replay").',
    )

    @property
    def log_max_bytes(self) -> int | None:
        return max(1, int(self.log_max_mb * (1 << 20))) if self.log_max_mb else None


class ModelConfig(_Section):
    path: Path = Field(
        Path("models/tiny-arith"), description="An HF model directory (config.json + safetensors + tokenizer)."
    )
    init_if_missing: bool = Field(
        True, description="Build the tiny built-in model at `path` when nothing is there yet."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="The dtype vLLM serves in.")
    max_seq_len: int = Field(
        256, gt=8, description="Longest prompt + completion in tokens (also vLLM's --max-model-len)."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the trainer's backward pass (less memory, more time)."
    )


# vLLM options grpod puts on every engine's command line, each with what decides it: neither
# inference.extra_args nor a leader's launch (`grpod agent`) may set them.
RESERVED_VLLM_OPTIONS = {
    "--host": "inference.host",
    "--port": "inference.port",
    "--api-key": "inference.api_key",
    "--uds": "inference.host and inference.port: engines listen on TCP",
    "--model": "model.path and the run's weight versions",
    "--served-model-name": "grpod's served names: policy, model.path",
    # A YAML file of options that vLLM reads under the command line's: it could set any of the above.
    "--config": "the options above, from [inference] and [model]",
}


def reserved_vllm_option(arg: str) -> str | None:
    """The reserved option (`RESERVED_VLLM_OPTIONS`) that the command-line item `arg` sets as vLLM's
    parser reads it, else None. vLLM reads `_` as `-` and `--key.field` as `--key`, and argparse
    takes any unambiguous prefix of an option for it (`--hos 0.0.0.0` sets --host). No vLLM option
    is itself a prefix of a reserved one, so every prefix counts, ambiguous or not."""
    if not arg.startswith("--"):
        return None
    name = arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    if len(name) < 3:
        return None
    return next((option for option in RESERVED_VLLM_OPTIONS if option.startswith(name)), None)


def refuse_reserved_vllm_options(args: list[str], decider: str) -> list[str]:
    """`args`, unless one sets a reserved option: then a ValueError naming it and what decides it."""
    for arg in args:
        option = reserved_vllm_option(arg)
        if option:
            raise ValueError(
                f"{arg!r} sets vLLM's {option}, which {decider} decides ({RESERVED_VLLM_OPTIONS[option]}); "
                "extra_args may not set it, nor spell it abbreviated or with '_'"
            )
    return args


class InferenceConfig(_Section):
    host: str = Field(
        "127.0.0.1", description="vLLM binds here; an address that is not loopback needs inference.api_key."
    )
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="vLLM's port; 0 = a free port (a relaunch keeps the port the first launch used while it is "
        "free). A fixed port that is taken is an error.",
    )
    start_timeout_s: float = Field(
        180.0,
        gt=0,
        description="vLLM start-up until /health answers (15-26 s for the tiny model on 2 idle cores; over "
        "100 s on a loaded machine).",
    )
    stop_grace_s: float = Field(
        5.0, gt=0, description="SIGTERM to vLLM's process group, then this long, then SIGKILL."
    )
    release_timeout_s: float = Field(
        60.0, gt=0, description="Wait for a stopped vLLM's processes, port and GPU memory to be gone."
    )
    request_timeout_s: float = Field(
        120.0, gt=0, description="Any HTTP request to vLLM but a generation's and the engine core's own answers "
        "(stall_timeout_s)."
    )
    generation_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="One generation request (a group's completions, an evaluated row): a healthy generation "
        "takes as long as its tokens do, and an engine that stops generating is found sooner, by the stall "
        "watch (stall_timeout_s). This bounds a request that an engine generating for others never finishes.",
    )
    stall_timeout_s: float = Field(
        60.0,
        gt=0,
        description="An engine with requests in flight whose token counters (vLLM's /metrics) do not move for "
        "this long is stalled: it still answers /health (a frozen engine core does), and it is relaunched like "
        "one that stopped answering. It also bounds what the engine core answers between two of its steps "
        "(a sync's pause; after a failed sync request, whether it is paused): a core silent for this long is "
        "stalled too. Raise it above the longest prefill of one prompt.",
    )
    health_interval_s: float = Field(0.5, gt=0, description="/health probe period while serving.")
    health_failures: int = Field(
        3, ge=1, description="Consecutive failed /health probes before the engine is declared dead and relaunched. "
        "A probe fails when /health answers anything but 200 or does not answer within request_timeout_s: a "
        "process that exited is seen at once, a frozen one after health_failures x request_timeout_s.",
    )
    kv_cache_bytes: str = Field(
        "64M",
        pattern=r"^(\d+|\d+(\.\d+)?[kmgt]|\d+[KMGT])$",
        description="CPU: vLLM's --kv-cache-memory-bytes: bytes, or a number with k/m/g/t (powers of 1000) or "
        "K/M/G/T (powers of 1024, whole numbers only).",
    )
    gpu_memory_utilization: float = Field(
        0.45,
        gt=0,
        le=1,
        description="GPU: vLLM's --gpu-memory-utilization (leave room for a trainer on the same GPU).",
    )
    block_size: Literal["auto"] | Annotated[int, Field(ge=16, le=256, multiple_of=16)] = Field(
        "auto",
        description="vLLM's --block-size, the KV cache's block in tokens. A group's completions share their "
        "prompt, and vLLM serves a prompt from its prefix cache in whole blocks only: with a block longer "
        'than the prompt, the prompt is computed once per completion. "auto" = 32 on a CPU (vLLM\'s CPU '
        "default, 128, is longer than most prompts; its CPU attention takes multiples of 32 only: "
        "bench/engine_batch.py), vLLM's own on a GPU (16).",
    )
    enforce_eager: bool = Field(
        True,
        description="Skip torch.compile and CUDA graphs: faster start, slower decode (CPU: also "
        "TORCHDYNAMO_DISABLE=1, so the first logprobs request compiles nothing).",
    )
    cpu_executor: Literal["auto", "uni", "mp"] = Field(
        "auto",
        description='CPU engines: "uni" runs vLLM\'s worker inside its EngineCore, forked from the API server '
        "(two processes, one import of vLLM: 17 s to /health here instead of 40 s; OMP_NUM_THREADS = cores - 1 "
        'unless inference.env sets it); "mp" is vLLM\'s CPU default (a Worker process of its own, pinned by '
        'VLLM_CPU_OMP_THREADS_BIND); "auto" = "uni" unless the engine\'s cores are pinned (inference.engines > 1, '
        "cpu_binds, or VLLM_CPU_OMP_THREADS_BIND in inference.env). GPU: unused.",
    )
    borrow_trainer_cores: Literal["auto"] | bool = Field(
        "auto",
        description="CPU: while the trainer waits for rollouts, the engine runs on its threads plus the "
        "trainer's (train.threads), given back before the step trains (grpod.inference.cores). Needs one engine "
        'on this node with cpu_executor "uni" and the trainer on the CPU; "auto" = on for such an engine whose '
        "model has at least 64 MiB of weights (a tiny model's engine gains nothing).",
    )
    api_key: str | None = Field(
        None,
        description="API key required on every route when `host` is not a loopback address.",
        examples=["..."],
    )
    extra_args: list[str] = Field(
        [],
        description="Arguments appended to vLLM's command line, options spelled in full (grpod's vLLM server "
        f"takes no abbreviation). Not the options grpod decides ({', '.join(RESERVED_VLLM_OPTIONS)}: set "
        "inference.host, port, api_key instead), in any spelling.",
    )
    env: dict[str, str] = Field({}, description="Extra environment variables for vLLM.")
    max_restarts: int = Field(
        3,
        ge=0,
        description="vLLM crash relaunches per engine before the run stops (checkpoint, exit 1); a relaunch "
        "that dies or hangs while starting is tried again and counts as one more.",
    )
    engines: int = Field(
        1,
        ge=0,
        description="Engines on this node, each its own vLLM process group, port (inference.port + i when "
        "fixed), log (vllm.log for engine 0, vllm-<i>.log after) and restart budget; requests go to the available one with the fewest "
        "outstanding. Each engine's cores (CPU: VLLM_CPU_OMP_THREADS_BIND) or GPU (CUDA_VISIBLE_DEVICES) come "
        "from cpu_binds / gpu_ids, else engine i takes core / GPU i. 0: none on this node, every engine is a "
        "`grpod agent`'s (cluster.agents).",
    )
    cpu_binds: list[str] = Field(
        [],
        description='CPU: each engine\'s VLLM_CPU_OMP_THREADS_BIND, one entry per engine, e.g. ["0", "1"] '
        "(default: engine i on core i).",
    )
    gpu_ids: list[str] = Field(
        [],
        description='GPU: each engine\'s CUDA_VISIBLE_DEVICES, one entry per engine, e.g. ["0", "1"] '
        "(default: engine i on GPU i).",
    )

    @field_validator("extra_args")
    @classmethod
    def _no_reserved_option(cls, args: list[str]) -> list[str]:
        return refuse_reserved_vllm_options(args, "grpod")

    @model_validator(mode="after")
    def _one_binding_per_engine(self) -> InferenceConfig:
        for key in ("cpu_binds", "gpu_ids"):
            given = getattr(self, key)
            if given and len(given) != self.engines:
                raise ValueError(f"inference.{key} has {len(given)} entries for inference.engines = {self.engines}")
        return self


# Reward functions every dataset source knows by name (`grpod/rollouts/rewards.py` has them).
BUILTIN_REWARDS = ("math", "exact", "last_number", "regex_format", "reasoning_gym")


class RewardFunctionConfig(_Section):
    """One reward function of the dataset source: a builtin name, "package.module:function", or
    "path/to/file.py:function" (a path relative to the working directory)."""

    function: str = Field(
        description='A builtin ("math", "exact", "last_number", "regex_format", "reasoning_gym": the task\'s own '
        'verifier on rows `grpod reasoning-gym` wrote), "package.module:function" or "path/to/file.py:function"; '
        "called by keyword as TRL calls it: prompts, completions, completion_ids, trainer_state, every other column.",
        examples=["math"],
    )
    weight: float = Field(1.0, description="Weight of this function's reward in the combined score.")
    name: str | None = Field(
        None,
        description="The name of its metric (`reward/<name>` in metrics.jsonl); default the builtin's name or the "
        "function's attribute name.",
        examples=["correct"],
    )
    pattern: str | None = Field(
        None,
        description="regex_format: the regular expression a completion must match (re.search, DOTALL; required). "
        "reasoning_gym: where the answer is read, the last match of this expression (its first group if it has "
        "one; DOTALL), e.g. \"-?\\\\d+\" for the last number; default the last <answer>...</answer>, else the whole "
        "completion.",
        examples=["^\\d+$"],
    )

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
        if self.function == "regex_format" and not self.pattern:
            raise ValueError("function = 'regex_format' needs pattern = \"<regular expression>\"")
        if self.pattern is None:
            return self
        if self.function not in ("regex_format", "reasoning_gym"):
            raise ValueError(f"pattern is a key of function = 'regex_format' or 'reasoning_gym', not of {self.function!r}")
        try:
            compiled = re.compile(self.pattern)
        except re.error as exc:
            raise ValueError(f"pattern {self.pattern!r} is not a regular expression: {exc}") from None
        if self.function == "reasoning_gym" and compiled.groups > 1:
            raise ValueError(f"pattern {self.pattern!r} has {compiled.groups} groups; the answer is its first, give it one")
        return self

    @property
    def metric_name(self) -> str:
        return self.name or self.function.rpartition(":")[2]


class CurriculumConfig(_Section):
    """source.dataset.curriculum: draw rows from the difficulty level the policy passes about half
    the time (`grpod/rollouts/curriculum.py`)."""

    column: str = Field(
        "level",
        description="The integer column holding each row's difficulty level (`grpod reasoning-gym --level` writes "
        "it); rows are drawn from one level at a time, each level in its own shuffled endless order.",
    )
    band: tuple[float, float] = Field(
        (0.3, 0.7),
        description="The pass rate kept: after `window` groups at a level, a mean pass rate above the upper bound "
        "moves to the next harder level, one below the lower bound to the next easier one. A completion passes "
        "when its score is at least eval.correct_threshold.",
    )
    window: int = Field(8, ge=1, le=10_000, description="Groups at a level between two decisions.")
    start: int | None = Field(None, description="The level to start at; unset: the lowest in the file.", examples=[0])

    @model_validator(mode="after")
    def _check_band(self) -> CurriculumConfig:
        low, high = self.band
        if not 0.0 <= low < high <= 1.0:
            raise ValueError(f"band {list(self.band)}: expected [low, high] with 0 <= low < high <= 1")
        return self


class DatasetConfig(_Section):
    """source.kind = "dataset": prompts from a local JSONL / Parquet / CSV file, scored by reward
    functions (`grpod/rollouts/dataset.py`, `grpod/rollouts/rewards.py`)."""

    path: Path | None = Field(
        None,
        description="The training file: .jsonl / .json, .parquet or .csv (the format comes from the suffix).",
        examples=["data/train.jsonl"],
    )
    prompt_column: str = Field(
        "prompt",
        description="The string column holding a row's prompt; a dataset has this one or messages_column.",
    )
    messages_column: str = Field(
        "messages",
        description="The chat column holding a row's prompt as a list of {role, content} (TRL's conversational "
        "format).",
    )
    system_prompt: str | None = Field(
        None,
        description="A system turn put before every prompt (a messages row that has its own keeps it).",
        examples=["Answer with the number only."],
    )
    shuffle_seed: int = Field(0, description="Epoch e visits the rows in an order shuffled by (shuffle_seed, e).")
    epochs: int = Field(
        0,
        ge=0,
        description="Passes over the dataset, each in a new shuffled order; 0 = endless (train.steps ends the run).",
    )
    rest_epochs: int = Field(
        0,
        ge=0,
        description="Active sampling: a row whose last group carried no learning signal (every completion scored "
        "the same: always solved or never solved) is skipped for this many epochs, then drawn again; 0 = off. "
        "Skipped draws are counted as `rested` in the source's status. Live: set to 0, every resting row is drawn "
        "again.",
        examples=[2],
    )
    curriculum: CurriculumConfig | None = Field(
        None,
        description="Difficulty levels: rows carry a level, and the level drawn follows the running pass rate "
        "(a [source.dataset.curriculum] table; unset = off). Needs epochs = 0 and rest_epochs = 0.",
    )
    rewards: list[RewardFunctionConfig] = Field(
        [], description="The reward functions, one [[source.dataset.rewards]] table each (at least one)."
    )
    reward_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A reward call running longer than this drops its group (`reward_timeout`); its worker process "
        "is killed and replaced.",
    )
    reward_workers: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Worker processes that run the reward functions (unset: one per core, 2 to 8).",
        examples=[2],
    )
    reward_memory_mb: int = Field(
        2048,
        ge=64,
        description="A reward worker using more memory than this fails its call (`reward_memory`) and is replaced.",
    )
    reward_aggregation: Literal["sum", "normalize_then_sum"] = Field(
        "sum",
        description='How several functions\' rewards make a score: "sum" (weighted; TRL\'s sum_then_normalize) or '
        '"normalize_then_sum" (each function\'s rewards normalised in the group first).',
    )

    @model_validator(mode="after")
    def _check_curriculum(self) -> DatasetConfig:
        if self.curriculum is not None and (self.epochs or self.rest_epochs):
            raise ValueError(
                "curriculum draws each level endlessly and decides by level, not by row: it needs epochs = 0 and "
                f"rest_epochs = 0 (got epochs = {self.epochs}, rest_epochs = {self.rest_epochs})"
            )
        return self


_SOURCE_KIND = (
    'Where rollouts come from: "builtin" (arithmetic through vLLM), "dataset" (your prompts and reward '
    'functions), "environment" (multi-turn episodes: tools, games, verifiers or OpenEnv environments), "atropos" '
    '(Atropos\' trajectory API; Atropos is archived), "replay" (an earlier run\'s groups); a key of another kind '
    "is an error, except the file's when `--set` switches the kind."
)


class _SourceCommon(_Section):
    """What every rollout source has: the group shape, the sampling contract, the prefetch queue
    and the source alarm."""

    group_size: int = Field(8, ge=1, description="Completions per prompt.")
    max_tokens: int = Field(16, ge=1, description="Completion length cap, in tokens.")
    temperature: float = Field(
        1.0,
        ge=0.01,
        le=2.0,
        description="Sampling temperature; the trainer divides its logits by the same one. At least 0.01: vLLM "
        "samples greedily below 1e-5 and warns of numerical errors below 0.01, and a tiny temperature overflows "
        "the trainer's logits. At most 2: vLLM refuses every request above it (HTTP 400, temperature must be "
        "in [0, 2]).",
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Only 1.0: the trainer computes full-vocabulary logprobs, so nucleus truncation would bias "
        "every importance weight (refused rather than silently off-policy).",
    )
    prefetch_groups: int = Field(
        16, ge=1, description="Groups generated ahead of the trainer (the bounded prefetch queue)."
    )
    concurrency: int = Field(4, ge=1, description="Generation requests in flight.")
    overlap: bool = Field(
        True,
        description="Generate the next groups while the trainer trains (false = a synchronous loop, for comparison).",
    )
    error_alarm_s: float = Field(
        60.0,
        gt=0,
        description="A source failing this long without a single success raises the source alarm (console, "
        "`ctl status`, Prometheus, systemd STATUS).",
    )
    fail_after_s: float | None = Field(
        None,
        gt=0,
        description="A source failing this long without a single success ends the run, exit 1 (unset: never).",
        examples=[600.0],
    )

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

    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling (builtin and dataset sources): a group whose scores are all equal is "
        "not queued; generation goes on until the step has groups with signal.",
    )
    dynamic_sampling_max_filtered: int = Field(
        256,
        ge=1,
        description="After this many filtered groups in a row one is let through anyway (counted), so a saturated "
        "task cannot stall a run.",
    )


class BuiltinSourceConfig(_SamplingSourceCommon):
    """source.kind = "builtin": integer arithmetic with a verifier (`grpod/rollouts/arithmetic.py`)."""

    kind: Literal["builtin"] = Field("builtin", description=_SOURCE_KIND)
    task_seed: int = Field(1234, description="Seed of the builtin problem stream.")
    task_prompt: Literal["auto", "bare", "instruct"] = Field(
        "auto",
        description='The arithmetic prompt: "bare" (`37+45=`, exact answer: the tiny model), "instruct" (a chat '
        'question, the last integer of the answer is scored: a chat model; max_tokens >= 24), "auto" (by the '
        "tokenizer's vocabulary: bare for grpod's tiny tokenizer).",
    )


class DatasetSourceConfig(_SamplingSourceCommon):
    """source.kind = "dataset": your prompts and reward functions (`[source.dataset]`)."""

    kind: Literal["dataset"] = Field("dataset", description=_SOURCE_KIND)
    dataset: DatasetConfig = Field(
        DatasetConfig(), description="Your prompts and reward functions (etc/examples/smollm2-dataset.toml runs one)."
    )

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


class EnvironmentConfig(_Section):
    """source.kind = "environment": multi-turn episodes against an environment (`[source.environment]`,
    `grpod/rollouts/environment_source.py`)."""

    adapter: Literal["calculator", "openenv", "verifiers"] = Field(
        "calculator",
        description='What plays the environment\'s side: "calculator" (grpod\'s arithmetic word problems with a '
        'calculator tool), "openenv" (an OpenEnv environment: `name` served by a server grpod starts, or `url`), '
        '"verifiers" (a verifiers environment `name`, run in its own venv\'s process).',
    )
    name: str | None = Field(
        None,
        description='openenv: the environment class, "package.module:Class" or "path/to/file.py:Class"; verifiers: '
        "the environment's module name as `vf.load_environment` takes it (its directory goes on `path`).",
        examples=["etc/examples/agent-envs/guess_env.py:GuessEnvironment"],
    )
    args: dict[str, Any] = Field(
        {}, description="Keyword arguments the environment is built with (a TOML table)."
    )
    url: str | None = Field(
        None,
        description="openenv: the base URL of an environment server you started (grpod then starts none).",
        examples=["http://127.0.0.1:8010"],
    )
    python: Path | None = Field(
        None,
        description="verifiers: the interpreter of the venv that has verifiers (unset: .venv-verifiers/bin/python, "
        "which `make verifiers` builds).",
        examples=[".venv-verifiers/bin/python"],
    )
    path: list[Path] = Field(
        [], description="Directories put first on the environment process's import path (your environment's code)."
    )
    max_turns: int = Field(4, ge=1, le=64, description="Model turns per episode at most.")
    max_episode_tokens: int | None = Field(
        None,
        ge=8,
        description="Tokens per episode, prompt and tool turns included (unset: model.max_seq_len).",
        examples=[1024],
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="One environment call (a reply to a model turn, a reward) taking longer than this drops its "
        "group (`environment_timeout`). The call is abandoned (a verifiers worker cancels it); an OpenEnv server "
        "grpod started is killed and restarted at its fourth stuck call, or its first if it runs one session's "
        "step at a time.",
    )
    start_timeout_s: float = Field(
        120.0, gt=0, description="How long an environment process grpod starts may take to answer its health check."
    )
    task_seed: int = Field(1234, description="Seed of the task stream (task i of a run is a function of it and i).")
    memory_mb: int = Field(
        8192, ge=0,
        description="openenv (a server grpod starts) and verifiers: the environment process's memory cap (RLIMIT_DATA), "
        "in MiB: an allocation past it fails in the environment's code (its episode's environment_error, or a crash "
        "and a restart) rather than growing until the kernel's OOM killer picks a process, perhaps the daemon. 0: none "
        "(an environment that maps GPU memory may need it).",
    )


class EnvironmentSourceConfig(_SamplingSourceCommon):
    """source.kind = "environment": multi-turn episodes, token in / token out (`[source.environment]`).
    `max_tokens` caps each model turn; `concurrency` is groups in flight."""

    kind: Literal["environment"] = Field("environment", description=_SOURCE_KIND)
    environment: EnvironmentConfig = Field(EnvironmentConfig(), description="The environment and its limits.")

    @model_validator(mode="after")
    def _adapter_needs(self) -> EnvironmentSourceConfig:
        env = self.environment
        if env.adapter == "verifiers" and not env.name:
            raise ValueError("source.environment.adapter = 'verifiers' needs source.environment.name (the environment)")
        if env.adapter == "openenv" and not (env.name or env.url):
            raise ValueError(
                "source.environment.adapter = 'openenv' needs source.environment.name (an Environment class grpod "
                "serves) or source.environment.url (a server you started)"
            )
        return self


class AtroposSourceConfig(_SourceCommon):
    """source.kind = "atropos": scored groups from Atropos' trajectory API (`run-api`). Atropos was
    archived on 2026-07-04 and its users are moving to verifiers and openenv: kept for existing
    environments (docs/atropos.md); a new task starts from "dataset"."""

    kind: Literal["atropos"] = Field("atropos", description=_SOURCE_KIND)
    atropos_url: str = Field("http://127.0.0.1:8000", description="Base URL of Atropos' trajectory API (run-api).")
    atropos_poll_s: float = Field(
        0.5, gt=0, description="First back-off when /batch is empty or fails (doubles up to 8 s)."
    )
    atropos_undeclared_temperature: Literal["config", "refuse"] = Field(
        "config",
        description='A group that declares no sampling temperature: "config" trains it at source.temperature '
        '(recorded with the group, counted, warned about once), "refuse" rejects it (`undeclared_temperature`). '
        "Environments should declare it: logprobs depend on it.",
    )


class ReplaySourceConfig(_SourceCommon):
    """source.kind = "replay": the groups an earlier run consumed (run.record_rollouts), in order."""

    kind: Literal["replay"] = Field("replay", description=_SOURCE_KIND)
    replay_path: Path | None = Field(
        None,
        description="The rollouts.jsonl of an earlier run (run.record_rollouts); required with kind \"replay\".",
        examples=["runs/old/rollouts.jsonl"],
    )

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


def _members(union: Any) -> dict[str, type[BaseModel]]:
    """A discriminated section's kinds, tag → model, in declaration order (the first is the
    default: what a section that names no kind means)."""
    members = {}
    for arm in get_args(get_args(union)[0]):
        model, *meta = get_args(arm)
        members[next(m.tag for m in meta if isinstance(m, Tag))] = model
    return members


SourceConfig = Annotated[
    Annotated[BuiltinSourceConfig, Tag("builtin")]
    | Annotated[DatasetSourceConfig, Tag("dataset")]
    | Annotated[EnvironmentSourceConfig, Tag("environment")]
    | Annotated[AtroposSourceConfig, Tag("atropos")]
    | Annotated[ReplaySourceConfig, Tag("replay")],
    _tag("builtin", "kind"),
]
SOURCE_KINDS = tuple(_members(SourceConfig))


class LossConfig(_Section):
    """The policy loss (`grpod/training/loss.py` has the formulas).

    `type` picks the per-token objective: `grpo` and `dapo` PPO's clipped ratio (dapo = grpo with
    the token-mean aggregation, DAPO's name for it), `dr_grpo` the same objective with Dr. GRPO's
    constant normaliser and no std scaling of advantages, `cispo` the clipped, stop-gradient ratio
    times the logprob, `gspo` a sequence-level (geometric-mean) ratio clipped per sequence. A type
    chooses `aggregation` (and for dr_grpo `train.advantages.scale`) unless those keys are set.
    """

    type: Literal["grpo", "dapo", "dr_grpo", "cispo", "gspo"] = Field(
        "grpo",
        description='The per-token objective: "grpo" (PPO clip), "dapo" (the same, token mean enforced), "dr_grpo" '
        '(constant normaliser, no std scaling), "cispo" (clipped, detached IS weight times the logprob), "gspo" '
        "(sequence-level ratio and clip).",
    )
    clip_low: float = Field(
        0.2,
        ge=0,
        description="Ratio floor 1 - clip_low of the PPO clip (and of CISPO's weight, GSPO's sequence ratio); "
        "below 1. It binds only when a batch gets several updates (train.epochs > 1 or train.minibatches > 1): "
        "with one update the ratio is exactly 1.",
    )
    clip_high: float = Field(
        0.28,
        ge=0,
        le=100,
        description="Ratio ceiling 1 + clip_high (DAPO's clip-higher); binds as clip_low does. At most 100 (10 "
        "already leaves a ratio practically unclipped): a huge ceiling overflows the float32 clamp and fails the step.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        le=100,
        description="Weight of the KL(pi || ref) penalty (0 = off). At most 100 (typical values are 0.001 to 1): a "
        "huge coefficient overflows the loss.",
    )
    kl_reference: Literal["inference", "model"] = Field(
        "inference",
        description='The KL reference: the "inference" logprobs, or a frozen reference "model" (model.path, '
        "loaded when a step first needs it).",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="Estimator of KL(pi || ref) reported and added to the loss; all three get the same, exact "
        "reverse-KL gradient (the per-token coefficient logp - logp_ref clamped to +-kl_clamp).",
    )
    kl_clamp: float = Field(
        10.0,
        gt=0,
        le=100,
        description="Bound on |logp - logp_ref| in each token's KL gradient coefficient (and on k3's value). At most "
        "100: a gap of 100 nats is a broken token already, and a huge bound overflows the float32 clamp and fails "
        "every step.",
    )
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description='How token losses make the batch loss: "token_mean", "seq_mean_token_mean" or '
        '"seq_mean_token_sum_norm" (Dr. GRPO); unset, `type` chooses it (dr_grpo: seq_mean_token_sum_norm, '
        "gspo: seq_mean_token_mean, else token_mean).",
    )
    max_completion_tokens: int = Field(
        0,
        ge=0,
        description="Dr. GRPO's constant M (seq_mean_token_sum_norm) and the overlong budget; 0 = the source's "
        "completion budget (source.max_tokens; for an environment, max_turns x max_tokens within "
        "max_episode_tokens; for Atropos, model.max_seq_len, which grpod registers as max_token_len).",
    )
    tis_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop", "off"] = Field(
        "token_truncate",
        description="Correction of the trainer/vLLM mismatch with the weight rho = pi_old / pi_inference: "
        "token_truncate clamp(rho_t, tis_floor, tis_cap); token_mask rho_t inside [tis_floor, tis_cap], else 0; "
        "sequence_truncate and sequence_mask the same with the sequence's product of token ratios; icepop a "
        'two-sided token mask; "off" no correction (weight 1).',
    )
    tis_cap: float = Field(
        2.0,
        gt=0,
        le=1e9,
        description="Upper bound C of the IS weight (truncate at it, or mask above it). At most 1e9: rho is at most "
        "exp(20), about 4.9e8, so a larger cap never binds, and a huge one overflows the float32 clamp.",
    )
    tis_floor: float = Field(
        0.0,
        ge=0,
        description="Lower bound of the IS weight, below tis_cap: the mask modes mask below it, the truncate modes "
        "raise smaller weights to it (TRL's clip_min); icepop needs > 0, e.g. 0.5.",
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        le=100,
        description="Entropy bonus weight (0 = entropy is a metric only); at most 100, like kl_coef.",
    )
    mask_truncated: bool = Field(
        False,
        description="No loss on completions that hit max_tokens (Atropos: overrides truncated / finish_reason "
        '"length"; an environment\'s episode: its last model turn hit max_tokens, or the episode its token budget '
        "while the environment would have gone on; one that used its max_turns is complete).",
    )
    logprob_chunk_tokens: int = Field(
        1024, ge=1, description="The trainer's fp32 log-softmax is computed this many tokens at a time."
    )

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

    estimator: Literal["grpo", "rloo", "reinforce_pp"] = Field(
        "grpo",
        description='"grpo": centred in the group, scaled by `scale`; "rloo": leave-one-out baseline (no '
        'scaling); "reinforce_pp": REINFORCE++, raw scores normalised over the whole step.',
    )
    scale: Literal["group", "batch", "none"] = Field(
        "group",
        description='grpo: divide by the "group" std, the "batch" std, or "none" (Dr. GRPO; train.loss.type = '
        '"dr_grpo" chooses it unless set).',
    )
    std: Literal["sample", "population"] = Field(
        "sample",
        description='The std of `scale`: "sample" (Bessel, n - 1: TRL\'s and verl\'s) or "population".',
    )
    drop_zero_variance: bool = Field(
        True,
        description="Drop what carries no signal: a group whose scores are all equal (grpo, rloo), or a step "
        "whose every score is equal (reinforce_pp, whose baseline is the step's).",
    )
    use_source_advantages: bool = Field(False, description="Use the advantages a source sends when present.")
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO's soft overlong punishment: a completion within this many tokens of the completion "
        "budget loses up to overlong_penalty of score, linearly (0 = off).",
    )
    overlong_penalty: float = Field(
        1.0, ge=0, description="The most score the overlong punishment takes (see overlong_buffer)."
    )


class LoraConfig(_Section):
    rank: int = Field(16, ge=1, description="The adapter's rank r.")
    alpha: float = Field(32.0, gt=0, description="The adapter's scaling alpha (scale alpha / r).")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="LoRA dropout; 0 so that the trainer computes the function vLLM serves."
    )
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="The modules the adapter wraps (all seven Llama / Qwen2 projections).",
    )


class TrainConfig(_Section):
    steps: int = Field(
        20,
        ge=1,
        description="Batches this run trains; `ctl status` and the summary count trained steps and skipped "
        "batches (every group rejected, zero-variance or non-finite) apart.",
    )
    groups_per_step: int = Field(8, ge=1, description="Groups (prompts) per batch.")
    lr: float = Field(
        2e-5,
        gt=0,
        le=1,
        description="Learning rate. At most 1: an optimizer step that moves every weight by more than 1 destroys "
        "any model.",
    )
    weight_decay: float = Field(
        0.0, ge=0, description="The optimizer's weight decay; on resume the config's value replaces the checkpoint's "
        "(logged), as train.lr does."
    )
    warmup_steps: int = Field(0, ge=0, description="Steps of linear learning-rate warm-up.")
    schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description='The learning-rate schedule, "constant" or "cosine"; it advances once per batch, skipped '
        "batches included.",
    )
    grad_clip: float = Field(1.0, gt=0, description="Max gradient norm.")
    optimizer: Literal["adamw", "adamw_8bit", "adafactor"] = Field(
        "adamw",
        description='"adamw" (fp32 states), "adafactor" or "adamw_8bit" (CUDA + bitsandbytes). A checkpoint of '
        'another optimizer is refused on resume (run.resume_mismatch = "allow": the optimizer starts afresh).',
    )
    micro_batch_tokens: int = Field(
        4096, ge=16, description="Padded tokens per micro-batch (gradient accumulation beyond)."
    )
    share_prompt: bool = Field(
        True,
        description="Forward a group's prompt once for all its completions: a micro-batch holds one group packed "
        "into one row, the prompt then each completion, without padding, masked so that each completion sees "
        "the prompt and itself only (the same loss and gradient up to float summation order; at most 1024 "
        "positions a row, a larger group is cut). Needs eager or SDPA attention; trainer ranks under torchrun "
        "forward padded rows.",
    )
    micro_batch_min_efficiency: float = Field(
        0.95,
        ge=0,
        le=1,
        description="A micro-batch is also cut where the next (longer) sequence would bring its share of real, "
        "unpadded tokens below this (0 = cut by micro_batch_tokens only).",
    )
    pad_to_multiple: int = Field(
        0,
        ge=0,
        le=4096,
        description="Round each micro-batch's length (a padded block's width, a packed row's positions) up to a "
        "multiple of this, so that a GPU sees a few shapes and reuses its kernel choices across steps (measured: "
        "bf16 LoRA 1.4-1.5x faster a step at 128; fp32 slower, docs/models.md); 0 = no rounding. The rounding "
        "can take a micro-batch past micro_batch_tokens. No real position attends to the padding and nothing "
        "reads its outputs.",
    )
    epochs: int = Field(
        1,
        ge=1,
        description="PPO epochs: each batch is trained this many times, against pi_old recorded before the "
        "batch's first update. With epochs = minibatches = 1 (one update per batch) the PPO clip cannot bind "
        "(see train.loss.clip_low).",
    )
    minibatches: int = Field(
        1, ge=1, description="Optimizer steps per epoch (the batch split in this many parts)."
    )
    disable_dropout: bool = Field(
        True,
        description="Run the training forward with dropout off, as vLLM serves the model, whatever the base "
        "config's dropout says (LoRA dropout included).",
    )
    logprob_gap_alarm: float = Field(
        0.05,
        gt=0,
        description="Alarm (log, console, `ctl status`) when |mean trainer - vLLM logprob| over the last 20 steps "
        "exceeds this (nats/token): a broken sampling contract, not staleness noise (grpod/daemon/alarms.py has "
        "the figures).",
    )
    max_staleness: int = Field(
        4,
        ge=0,
        description="Policy versions a group may lag behind the engine's weights, counted in versions (syncs: one "
        "every bridge.sync_every optimizer steps), not in optimizer steps.",
    )
    stale_policy: Literal["drop", "downweight"] = Field(
        "drop", description='Groups beyond max_staleness: "drop" or "downweight".'
    )
    lora: bool = Field(
        False, description='Train a LoRA adapter (needs bridge.mode "lora_only" or "lora_restart").'
    )
    device: str = Field(
        "cpu",
        description='"cpu", "cuda" or "cuda:N" (under torchrun "cuda" puts rank i on the GPU of its LOCAL_RANK).',
    )
    threads: int = Field(
        0, ge=0, description="Torch intra-op threads for the trainer (0 = torch's default); vLLM needs the rest."
    )
    borrow_engine_cores: Literal["auto"] | bool = Field(
        "auto",
        description="CPU: while generation is parked (the prefetch queue full, or source.overlap = false) and the "
        "engines on this node are idle, the trainer's micro-batches run on train.threads plus the engines' threads "
        '(grpod.inference.cores). Needs train.threads below the cores, a dataset or builtin source; "auto" = on for '
        "a model of at least 64 MiB of weights.",
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Trainer ranks under torchrun (grpod/training/distributed.py): every collective of a step, a "
        "sync's gather or a checkpoint, and rank 0's sending of each call, waits at most this long for the other "
        "ranks; a rank dead or frozen past it ends the run (exit 1) and torchrun the job.",
    )
    loss: LossConfig = Field(LossConfig(), description="The policy loss (grpod/training/loss.py).")
    advantages: AdvantageConfig = Field(
        AdvantageConfig(), description="How scores become advantages (grpod/training/advantages.py)."
    )
    lora_config: LoraConfig = Field(
        LoraConfig(),
        description="The LoRA adapter (with train.lora = true). Its rank, alpha and target modules are the run's: a "
        "checkpoint whose adapter has others (or that holds full weights) is refused on resume.",
    )

    @model_validator(mode="after")
    def _dr_grpo_scale(self) -> TrainConfig:
        # Dr. GRPO divides by no std; an explicit train.advantages.scale still wins.
        if self.loss.type == "dr_grpo" and "scale" not in self.advantages.model_fields_set:
            object.__setattr__(self.advantages, "scale", "none")
        return self


_BRIDGE_MODE = (
    'How a sync ships the trainer\'s weights to the engines: "none" (an HF checkpoint), "shared" (one copy, '
    'written in place), "lora_only" (adapter versions loaded live), "lora_restart" (vLLM relaunched with each '
    'adapter), "broadcast" (vLLM\'s weight-transfer API, every engine at once); a key of another mode is an error, '
    "except the file's when `--set` switches the mode."
)
_KEEP_ADAPTERS = "Adapter versions kept on disk."


class _BridgeCommon(_Section):
    """What every weight-bridge mode has: the sync cadence and the alignment probe."""

    sync_every: int = Field(1, ge=1, description="Optimizer steps between weight syncs (policy versions).")
    probe_tolerance: float = Field(
        0.02, gt=0, description="fp32 serving: max |vLLM - trainer| logprob over the probe positions."
    )
    probe_low_precision_mean: float = Field(
        0.07,
        gt=0,
        description="bf16/fp16 serving (model.dtype): rounding alone moves single tokens by ~0.2, so the mean "
        "|diff| is bounded by this (same weights measured 0.028; grpod/bridges/probe.py has the measurements).",
    )
    probe_low_precision_p95: float = Field(
        0.3,
        gt=0,
        description="bf16/fp16 serving: the bound on the 95th percentile of |diff| (same weights 0.10; one "
        "missed step 0.60).",
    )
    probe_every: int = Field(
        1,
        ge=1,
        description="Probe every N-th sync (1 = every sync); the first sync after any vLLM launch is always "
        "probed.",
    )
    probe_timeout_s: float = Field(60.0, gt=0, description="The longest one alignment probe may take.")


class NoneBridgeConfig(_BridgeCommon):
    """bridge.mode = "none": vLLM holds its own copy; a sync ships a full HF checkpoint."""

    mode: Literal["none"] = Field("none", description=_BRIDGE_MODE)
    reload: Literal["in_place", "restart"] = Field(
        "in_place",
        description='"in_place" (vLLM reload_weights, no restart, ~10 ms) or "restart" (stop vLLM, wait for its '
        "release, relaunch on the checkpoint).",
    )


class SharedBridgeConfig(_BridgeCommon):
    """bridge.mode = "shared": one copy of the weights, read by vLLM, written by the optimizer."""

    mode: Literal["shared"] = Field("shared", description=_BRIDGE_MODE)


class LoraOnlyBridgeConfig(_BridgeCommon):
    """bridge.mode = "lora_only": vLLM serves the base once and loads each adapter version."""

    mode: Literal["lora_only"] = Field("lora_only", description=_BRIDGE_MODE)
    keep_adapters: int = Field(3, ge=1, description=_KEEP_ADAPTERS)


class LoraRestartBridgeConfig(_BridgeCommon):
    """bridge.mode = "lora_restart": vLLM relaunched on the base with each adapter version."""

    mode: Literal["lora_restart"] = Field("lora_restart", description=_BRIDGE_MODE)
    keep_adapters: int = Field(3, ge=1, description=_KEEP_ADAPTERS)


class BroadcastBridgeConfig(_BridgeCommon):
    """bridge.mode = "broadcast": trainer rank 0 sends the weights to every engine at once through
    vLLM's weight-transfer API (`grpod/bridges/broadcast.py`, `grpod/weights/transfer.py`)."""

    mode: Literal["broadcast"] = Field("broadcast", description=_BRIDGE_MODE)
    transport: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description='"nccl" on GPU (vLLM\'s engine), "gloo" on CPU (grpod\'s engine, registered by its worker '
        'extension); "auto" picks by where vLLM runs.',
    )
    host: str = Field(
        "127.0.0.1",
        description="Where trainer rank 0 listens for the engines' workers: 127.0.0.1 for engines on this "
        "machine, an address of the trainer the agents reach for engines on other nodes (cluster.agents).",
    )
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Rank 0's port (0 = a free one). A fixed one (opened in a firewall for the agents' nodes) "
        "serves every weight group in turn: a new group waits for the last one to let it go (when a member died "
        "mid-sync, until the send stuck on it runs out: timeout_s, plus 60 s), then up to timeout_s for any other holder.",
    )
    chunk_bytes: int = Field(64 * 1024 * 1024, ge=1, description="Bytes per broadcast chunk.")
    inflight_chunks: int = Field(
        2, ge=1, description="Chunks the engines receive ahead of the one they load (double buffering)."
    )
    timeout_s: float = Field(
        120.0, gt=0, description="Bounds forming the group and every collective wait, on both sides."
    )


BridgeConfig = Annotated[
    Annotated[NoneBridgeConfig, Tag("none")]
    | Annotated[SharedBridgeConfig, Tag("shared")]
    | Annotated[LoraOnlyBridgeConfig, Tag("lora_only")]
    | Annotated[LoraRestartBridgeConfig, Tag("lora_restart")]
    | Annotated[BroadcastBridgeConfig, Tag("broadcast")],
    _tag("none", "mode"),
]
BRIDGE_MODES = tuple(_members(BridgeConfig))
LORA_MODES = ("lora_only", "lora_restart")


class CheckpointConfig(_Section):
    every: int = Field(
        0, ge=0, description="Steps between checkpoints (0 = only at `ctl checkpoint` and at shutdown)."
    )
    keep_last: int = Field(3, ge=1, description="Complete checkpoints kept; older ones are pruned.")
    at_shutdown: bool = Field(True, description="Write a checkpoint when the daemon stops.")


class EvalConfig(_Section):
    every: int = Field(0, ge=0, description="Held-out evaluation every N steps (0 = at start and end only).")
    size: int = Field(
        0,
        ge=0,
        description="Held-out problems evaluated (0 = no evaluation; the builtin task holds out 156; a dataset "
        "source evaluates the first `size` rows of eval.dataset).",
    )
    max_tokens: int = Field(
        8,
        ge=1,
        description="Completion length of an evaluation (dataset source: max(max_tokens, source.max_tokens)).",
    )
    seed: int = Field(99, description="Not read by any evaluation yet (the builtin held-out set is fixed).")
    dataset: Path | None = Field(
        None,
        description='source.kind = "dataset": the held-out split (same columns as source.dataset.path); its first '
        "`size` rows are evaluated.",
        examples=["data/eval.jsonl"],
    )
    k: int = Field(
        0,
        ge=0,
        description="Dataset source: besides greedy pass@1 (eval_accuracy), mean@k (eval_mean_at_k) averages the "
        "correctness of k samples at source.temperature (0 = not measured).",
    )
    correct_threshold: float = Field(
        1.0, description="Dataset source: a completion is correct when its combined reward is >= this."
    )
    overlap: bool = Field(
        True,
        description="Evaluate beside training: the step loop trains on while the engines decode the held-out "
        "set, keeping the evaluated version until it ends (a sync due meanwhile waits for it). false = the loop "
        'waits for each evaluation. The "shared" bridge always waits.',
    )


class ControlConfig(_Section):
    socket: NamedPath | None = Field(
        None,
        description="The control socket (mode 0600); unset: <run.dir>/grpod.sock.",
        examples=["runs/default/grpod.sock"],
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Longest a control request may wait (sync and checkpoint wait for a step boundary).",
    )


class NotifyConfig(_Section):
    watchdog: bool = Field(True, description="Send WATCHDOG=1 to systemd while steps progress.")
    stall_after_s: float = Field(
        600.0, gt=0, description="A step (or sync) running longer than this stops the heartbeat."
    )


class MetricsConfig(_Section):
    prometheus_port: int | None = Field(
        None, ge=1, le=65535, description="Serve a Prometheus text endpoint on this port (unset: none).", examples=[9464]
    )
    prometheus_host: str = Field("127.0.0.1", description="The address the Prometheus endpoint binds.")
    wandb_project: str | None = Field(
        None,
        description="Also log every numeric step and eval metric to this Weights & Biases project (unset: off).",
        examples=["grpod"],
    )
    wandb_entity: str | None = Field(
        None, description="The W&B entity (unset: the logged-in user's).", examples=["my-team"]
    )
    wandb_mode: Literal["online", "offline"] = Field(
        "online", description='"online", or "offline" (written under <run.dir>/wandb for a later `wandb sync`).'
    )
    memory_every_s: float = Field(
        30.0, gt=0, description="Read the resident memory of the daemon, of each engine on this node (its whole "
        "process group, and its GPU memory where NVML sees it) and of the daemon's other child processes this "
        "often: a `memory` record in metrics.jsonl, and `ctl status` with the change since the first reading.",
    )


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

    host: str = Field(
        "127.0.0.1", description="The agent's API binds here; the leader reaches it at http://HOST:PORT."
    )
    port: int = Field(7900, ge=1, le=65535, description="The agent's API port.")
    token: str | None = Field(
        None,
        description="The secret every route requires (`Authorization: Bearer <token>`, at least 16 characters); "
        "this or token_file is required to start an agent, and the leader's cluster.token must be the same.",
        examples=["..."],
    )
    token_file: Path | None = Field(
        None,
        description="A file whose first line is the token, read where it is used (instead of token).",
        examples=["/etc/grpod/agent.token"],
    )
    engines: int | None = Field(
        None,
        ge=1,
        description="Engines this agent serves, named engine-0, engine-1, ... (unset: inference.engines).",
        examples=[1],
    )
    dir: Path | None = Field(
        None,
        description="Its grpod.log, the engines' vLLM logs and launch records (unset: <run.dir>/agent).",
        examples=["runs/default/agent"],
    )

    @model_validator(mode="after")
    def _token_settings(self) -> AgentConfig:
        _check_token("agent", self.token, self.token_file)
        return self

    def token_value(self) -> str | None:
        return read_token("agent", self.token, self.token_file)


class ClusterConfig(_Section):
    """Engines on other nodes: each `grpod agent` in `agents` serves `engines_per_agent` engines to
    this daemon (the leader), beside the `inference.engines` of this node."""

    agents: list[str] = Field(
        [],
        description='The agents\' base URLs, e.g. ["http://10.0.0.2:7900", "http://10.0.0.3:7900"] (default port '
        '7900); needs bridge.mode = "broadcast" and a bridge.host the agents\' nodes reach.',
    )
    token: str | None = Field(
        None,
        description="The agents' agent.token (this or token_file is required with agents).",
        examples=["..."],
    )
    token_file: Path | None = Field(
        None, description="A file whose first line is the token (instead of token).", examples=["/etc/grpod/agent.token"]
    )
    engines_per_agent: int = Field(1, ge=1, description="Engines each agent serves to this leader.")
    request_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Any one request to an agent but a launch (launches wait for vLLM: inference.start_timeout_s).",
    )
    watch_poll_s: float = Field(
        30.0,
        gt=0,
        le=60,
        description="The leader watches each remote engine with a long-poll the agent answers at once when the "
        "engine ends, else after this long; an agent silent for this plus request_timeout_s is reported "
        "unreachable (`ctl status`), which by itself loses no engine: vLLM's /health decides.",
    )

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
    run: RunConfig = Field(RunConfig(), description="The run: its directory, seed, resume and console.")
    model: ModelConfig = Field(ModelConfig(), description="The model trained and served.")
    inference: InferenceConfig = Field(
        InferenceConfig(), description="This node's vLLM engines: launch, health, restart, stop."
    )
    source: SourceConfig = Field(
        BuiltinSourceConfig(), description="Where the scored rollout groups come from, by `kind`."
    )
    train: TrainConfig = Field(TrainConfig(), description="The trainer: the step, the optimizer, batching, staleness.")
    bridge: BridgeConfig = Field(
        NoneBridgeConfig(),
        description="How the trainer's weights reach the engines, by `mode`, and the alignment probe after each "
        "sync.",
    )
    checkpoint: CheckpointConfig = Field(
        CheckpointConfig(), description="Crash-safe checkpoints in <run.dir>/checkpoints/."
    )
    eval: EvalConfig = Field(EvalConfig(), description="Held-out evaluation.")
    control: ControlConfig = Field(ControlConfig(), description="The control socket `grpod ctl` talks to.")
    notify: NotifyConfig = Field(NotifyConfig(), description="systemd notify: READY, STATUS and the watchdog.")
    metrics: MetricsConfig = Field(
        MetricsConfig(), description="Metrics beyond metrics.jsonl: Prometheus, Weights & Biases."
    )
    agent: AgentConfig = Field(AgentConfig(), description="`grpod agent` on an inference node (docs/agent.md).")
    cluster: ClusterConfig = Field(
        ClusterConfig(), description="The leader's side: engines on other nodes, served by `grpod agent`s."
    )

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
        if self.source.kind in ("builtin", "dataset", "environment"):  # grpod asks vLLM for the tokens
            asked = [("source.max_tokens", self.source.max_tokens)] + ([("eval.max_tokens", self.eval.max_tokens)]
                                                                      if self.eval.size else [])
            for key, tokens in asked:
                if tokens >= self.model.max_seq_len:
                    raise ValueError(
                        f"{key} = {tokens} is not below model.max_seq_len = {self.model.max_seq_len}: vLLM refuses "
                        "every request whose completion leaves no room for its prompt, so every group would be "
                        f"dropped; lower {key} or raise model.max_seq_len"
                    )
        self._advantages_agree()
        self._cluster_agrees()
        size = len(os.fsencode(str(self.socket_path)))
        if size > UNIX_PATH_MAX:
            raise ValueError(f"{self.socket_key}: the control socket {self.socket_path} is {size} bytes, over a Unix "
                             f"socket path's {UNIX_PATH_MAX}; set control.socket to a shorter path")
        return self

    def _advantages_agree(self) -> None:
        adv = self.train.advantages
        sampled = self.source.kind in ("builtin", "dataset", "environment")  # grpod draws the group
        if self.source.group_size < 2 and adv.estimator in ("grpo", "rloo") and not adv.use_source_advantages and sampled:
            raise ValueError(
                f"source.group_size = {self.source.group_size} with train.advantages.estimator = {adv.estimator!r}: a "
                "group of one has no sibling to compare with, so every group would be dropped and no step would "
                "train; use a group of 2 or more, or estimator = 'reinforce_pp' (a baseline over the step)"
            )
        if adv.overlong_buffer and adv.overlong_buffer >= self.completion_budget:
            raise ValueError(
                f"train.advantages.overlong_buffer = {adv.overlong_buffer} is not below the completion budget "
                f"({self.completion_budget} tokens): every completion would be punished for its length, a length "
                "reward even in a group whose scores are all equal; use a buffer shorter than the budget"
            )

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

    def advisories(self) -> list[str]:
        """Settings that are valid but most likely not meant: `check-config` and `start` say them
        as notes (a run may mean them: a schedule cut short, engines synced by hand)."""
        notes = []
        steps = self.train.steps
        if self.bridge.mode != "shared" and self.bridge.sync_every > steps:
            notes.append(
                f"bridge.sync_every = {self.bridge.sync_every} is more than train.steps = {steps}: no step's sync falls "
                "due, so the engines get trained weights only before an evaluation or at `ctl sync`, and the "
                "rollouts between come from older weights"
            )
        if self.train.warmup_steps >= steps:
            notes.append(
                f"train.warmup_steps = {self.train.warmup_steps} is not below train.steps = {steps}: the learning rate "
                f"never reaches train.lr (at the last step it is {steps / self.train.warmup_steps:.2g} of it)"
            )
        source = self.source
        if (source.kind == "environment" and source.environment.adapter == "verifiers" and self.eval.size
                and "eval" not in source.environment.args):
            notes.append(
                f"eval.size = {self.eval.size} with a verifiers environment and no source.environment.args.eval: a "
                f"taskset has no held-out split, so each evaluation plays training tasks 0-{self.eval.size - 1} and "
                "eval_accuracy is not a held-out figure; set args.eval to the held-out taskset's arguments (another "
                "seed, another split)"
            )
        return notes

    @property
    def completion_budget(self) -> int:
        """The completion length M of Dr. GRPO's normaliser and of overlong shaping: the explicit
        `train.loss.max_completion_tokens`, else the source's cap (`source.max_tokens`; an
        environment's episode has up to `max_turns` model turns of `max_tokens` each, within its
        episode's tokens; Atropos environments decide their own lengths, bounded by
        `model.max_seq_len`)."""
        if self.train.loss.max_completion_tokens:
            return self.train.loss.max_completion_tokens
        if self.source.kind == "environment":
            env = self.source.environment
            return min(env.max_turns * self.source.max_tokens, env.max_episode_tokens or self.model.max_seq_len)
        return self.model.max_seq_len if self.source.kind == "atropos" else self.source.max_tokens

    @property
    def socket_path(self) -> Path:
        return self.control.socket or self.run.dir / "grpod.sock"

    @property
    def agent_dir(self) -> Path:
        """Where `grpod agent` writes its grpod.log and its engines' logs and launch records."""
        return self.agent.dir or self.run.dir / "agent"

    @property
    def socket_key(self) -> str:
        """The key an error about `socket_path` names."""
        return "control.socket" if self.control.socket is not None else "run.dir (the socket is <run.dir>/grpod.sock)"

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
    except tomllib.TOMLDecodeError as exc:
        if raw.strip().startswith(('"', "'", "[", "{")):
            # Meant as TOML (a quoted string, a list, a table) and not valid: taken as a bare word it
            # kept its quotes, a relative path starting with '"' ("C:\x" escapes, an unclosed list).
            raise ConfigError(f"--set {shown(text)}: not a valid TOML value ({exc}); a backslash in a double-quoted "
                              "string starts an escape: use single quotes for a literal string ('C:\\x')") from None
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


# The discriminated sections: their tag key and their kinds (tag -> model, the default first);
# pydantic puts a kind's tag in an error's location.
_UNION_TAGS = {"source": ("kind", _members(SourceConfig)), "bridge": ("mode", _members(BridgeConfig))}


def _switch_kinds(tree: dict[str, Any], file_tree: dict[str, Any], overridden: set[tuple[str, ...]]) -> list[str]:
    """`--set bridge.mode=shared` on a file written for another mode switches the mode: the file's
    keys that only its own kind has (`bridge.reload` of mode "none") are dropped, and named in the
    returned notes. Keys no kind has, and keys set by `--set` itself, stay and fail validation."""
    notes = []
    for section, (tag, members) in _UNION_TAGS.items():
        before, after = file_tree.get(section), tree.get(section)
        if not isinstance(before, dict) or not isinstance(after, dict) or (section, tag) not in overridden:
            continue
        default = next(iter(members))
        old, new = before.get(tag, default), after.get(tag, default)
        if old == new or old not in members or new not in members:
            continue
        dropped = [key for key in after if key in before and (section, key) not in overridden
                   and key in members[old].model_fields and key not in members[new].model_fields]
        for key in dropped:
            del after[key]
        if dropped:
            notes.append(f"{section}.{tag} = {new!r} (--set) over the file's {old!r}: ignored the file's "
                         + ", ".join(f"{section}.{key}" for key in dropped) + f" (keys of {section}.{tag} = {old!r} only)")
    return notes


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


def read_config_tree(path: Path, *, max_bytes: int | None = None) -> dict[str, Any]:
    """A config file's TOML as a tree (not validated); ConfigError saying why it cannot be read.
    With `max_bytes` (a running daemon's reload), only a regular file of at most that many bytes:
    the read of a FIFO waits for a writer, forever if none comes, and a 16 MB TOML takes 15 s to
    parse."""
    try:
        text = path.read_text() if max_bytes is None else _read_regular_file(path, max_bytes).decode()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: TOML syntax error: {exc}") from None
    except (ValueError, RecursionError) as exc:  # an integer of > 4300 digits, nesting too deep
        raise ConfigError(f"{path}: unusable TOML: {str(exc)[:200]}") from None


def _read_regular_file(path: Path, max_bytes: int) -> bytes:
    """`path`'s bytes if it is a regular file of at most `max_bytes`, else ConfigError. Opened
    without blocking, so a FIFO is refused rather than waited on."""
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise ConfigError(f"{path}: not a regular file (a FIFO, a device or a directory): refused, its read "
                              f"may never end; give the path of the config file itself")
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ConfigError(f"{path}: over {max_bytes} bytes, more than a config file has: refused, its parse "
                          f"would hold the daemon")
    return data


def tree_keys(tree: dict[str, Any], prefix: str = "") -> set[str]:
    """The dotted keys a TOML tree sets (a table's keys, not the table; an array as one key)."""
    keys: set[str] = set()
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            keys |= tree_keys(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


def load_config(path: Path | str | None, overrides: list[str] = (), notes: list[str] | None = None) -> GrpodConfig:
    """Load `path` (None = all defaults), apply `--set` overrides, validate. What the overrides
    made grpod ignore in the file (`_switch_kinds`) and the config's `advisories` are appended
    to `notes`."""
    tree = read_config_tree(Path(path)) if path is not None else {}
    return config_from_tree(tree, str(path) if path is not None else "<defaults>", overrides, notes)


def config_from_tree(file_tree: dict[str, Any], origin: str, overrides: list[str] = (),
                     notes: list[str] | None = None) -> GrpodConfig:
    """`load_config` of a file already read (`read_config_tree`): a reload checks the tree it
    validates, not a second read of a file that may have changed in between."""
    tree = copy.deepcopy(file_tree)
    for text in overrides:
        apply_override(tree, text)
    switched = _switch_kinds(tree, file_tree, {tuple(parse_assignment(text)[0]) for text in overrides})
    if notes is not None:
        notes.extend(switched)
    if overrides:
        origin += " (with --set " + ", ".join(overrides) + ")"
    cfg = parse_config(tree, origin)
    if notes is not None:
        notes.extend(cfg.advisories())
    return cfg
