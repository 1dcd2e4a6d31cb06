"""The environment source (`source.kind = "environment"`): multi-turn episodes, token in / token out.

Each group is `source.group_size` episodes of one task: the adapter (`grpod.rollouts.environments`:
grpod's calculator, an OpenEnv or a verifiers environment) opens one fresh environment per
episode for task `index`, the episode runner (`grpod.rollouts.episode_runner`) plays them
concurrently against the policy's engines, each model turn capped at `source.max_tokens` tokens,
at most `source.environment.max_turns` turns, and the group is scored by the episodes' final
rewards. Tasks are drawn by index, so the source's cursor is one integer and a resumed run
continues the stream.

Every episode's opening messages must be the same (one task per group): an adapter that gives
different ones for one index is an error of the environment (`environment_error`). A group an
environment fails (`EnvironmentFailure`: crash, timeout, error) or a generation fails is dropped
with its reason and counted; training goes on. With `source.dynamic_sampling`, groups without a
learning signal are not queued, as for the other sampling sources.

Evaluation: one greedy episode of each of the first `eval.size` tasks of the "eval" split;
`eval_accuracy` is the share whose reward reaches `eval.correct_threshold`, `eval_reward` their
mean reward.

The adapter lives as long as the run: `prepare_environment` builds and enters it (starting its
processes) before any engine launches, and opens task 0 once, so a name that does not import or
an environment that cannot start stops `grpod start` with exit 2 before anything else runs. Task
0's opening is tokenized there as every episode tokenizes it (`opening_ids`): one that leaves no
room for a model turn within the episode's tokens is refused too, since every group of such
tasks would drop as `prompt_too_long` and no step would train. Dropped groups are counted each,
and said on the console once per reason every `REPEAT_EVERY_S` (`ThrottledWarnings`).
"""

from __future__ import annotations

from collections import deque
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog

from grpod.config import ConfigError, EnvironmentConfig, EnvironmentSourceConfig, EvalConfig
from grpod.errors import first_error
from grpod.inference.policy import Policy
from grpod.rollouts.chat_turns import ChatTurns, Message, model_tokenizer
from grpod.rollouts.dynamic_sampling import DynamicSampling
from grpod.rollouts.environments import (
    EnvironmentAdapter,
    EnvironmentFailure,
    EnvironmentTimeout,
    Split,
    TurnEnvironment,
)
from grpod.rollouts.episode_runner import EpisodeLimits, EpisodeRunner, opening_ids
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.held_out import play_rows
from grpod.rollouts.sampling_source import GENERATION_RETRY_S, SamplingSource, SamplingStats, ThrottledWarnings

log = structlog.get_logger(__name__)

# Held-out episodes in flight at once during an evaluation: fewer than single-turn rows
# (held_out.EVAL_CONCURRENCY), each holds an environment session too.
EVAL_EPISODES = 16
# The source's own bound on an environment call exceeds `source.environment.timeout_s` by this
# much: an adapter that bounds its calls itself (and kills a stuck process) acts first.
ADAPTER_MARGIN_S = 5.0
# Environment metrics are averaged over this many of the last episodes.
ENV_METRIC_WINDOW = 256


def make_adapter(cfg: EnvironmentConfig, run_dir: Path) -> EnvironmentAdapter:
    """The adapter `cfg.adapter` names (imported only when asked for)."""
    if cfg.adapter == "openenv":
        from grpod.rollouts.openenv_adapter import OpenEnvAdapter

        return OpenEnvAdapter(cfg, run_dir=run_dir)
    if cfg.adapter == "verifiers":
        from grpod.rollouts.verifiers_adapter import VerifiersAdapter

        return VerifiersAdapter(cfg, run_dir=run_dir)
    from grpod.rollouts.calculator import CalculatorAdapter

    return CalculatorAdapter(cfg, run_dir=run_dir)


def episode_token_limit(env: EnvironmentConfig, max_seq_len: int) -> int:
    """The tokens one episode may hold, prompt included: source.environment.max_episode_tokens
    within model.max_seq_len."""
    return min(env.max_episode_tokens or max_seq_len, max_seq_len)


async def prepare_environment(
    src: EnvironmentSourceConfig,
    run_dir: Path,
    resources: AsyncExitStack,
    *,
    max_seq_len: int,
    model_path: Path,
    tokenizer=None,
) -> EnvironmentAdapter:
    """The run's adapter, entered into `resources` (left when the run ends), its first task opened
    once as a check and its opening tokenized (with `tokenizer`, default model_path's; skipped
    while the model is not built yet); any failure is a `ConfigError` naming the environment
    (module docstring)."""
    env = src.environment
    what = f"source.environment (adapter {env.adapter!r}{f', name {env.name!r}' if env.name else ''})"
    try:
        adapter = make_adapter(env, run_dir)
        await resources.enter_async_context(adapter)
        _check_capacity(adapter, src, what)
        with anyio.fail_after(env.start_timeout_s):
            messages, episode = await adapter.open(0, "train")
            await episode.aclose()
    except TimeoutError:
        raise ConfigError(f"{what}: opening its first task took longer than {env.start_timeout_s:g} s") from None
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 — whatever the environment's code raised, said once, exit 2
        raise ConfigError(f"{what} cannot start: {type(exc).__name__}: {exc}") from exc
    if not messages:
        raise ConfigError(f"{what}: task 0 opens with no messages; an episode needs a prompt")
    if tokenizer is None:
        tokenizer = await anyio.to_thread.run_sync(model_tokenizer, model_path)
    if tokenizer is not None:
        await anyio.to_thread.run_sync(_check_opening, messages, tokenizer, src, max_seq_len, what)
    return adapter


def _check_opening(messages: list[Message], tokenizer, src: EnvironmentSourceConfig, max_seq_len: int, what: str) -> None:
    """Task 0's opening as every episode takes it (`opening_ids`, within `episode_token_limit`):
    one that leaves no room for a model turn is a `ConfigError` saying which keys to raise."""
    env = src.environment
    try:
        opening_ids(ChatTurns(tokenizer), messages, episode_token_limit(env, max_seq_len))
    except EnvironmentFailure as failure:
        if failure.reason != "prompt_too_long":
            raise ConfigError(f"{what}: task 0: {failure}") from None
        keys = ("source.environment.max_episode_tokens (and model.max_seq_len, which bounds it)"
                if env.max_episode_tokens else "model.max_seq_len")
        raise ConfigError(
            f"{what}: task 0 does not fit: {failure}; every episode of such a task would be dropped "
            f"(prompt_too_long) and no step would train. model.max_seq_len = {max_seq_len}"
            + (f", source.environment.max_episode_tokens = {env.max_episode_tokens}" if env.max_episode_tokens else "")
            + f": raise {keys} to hold the opening and its model turns (source.max_tokens = {src.max_tokens} each), "
            "or give the environment shorter prompts"
        ) from None


def _check_capacity(adapter: EnvironmentAdapter, src: EnvironmentSourceConfig, what: str) -> None:
    """A server that holds fewer episodes at once than the run plays (`session_capacity`, where an
    adapter knows it) is refused: every group past it failed to open, and nothing ever trained."""
    capacity = getattr(adapter, "session_capacity", None)
    needed = src.group_size * src.concurrency
    if capacity is not None and capacity < needed:
        raise ConfigError(
            f"{what}: its server holds {capacity} episode(s) at once, and the run plays source.group_size x "
            f"source.concurrency = {needed}; an OpenEnv class serves one session unless it declares "
            "SUPPORTS_CONCURRENT_SESSIONS = True (do so if its instances share no state)"
        )


def _failure(exc: BaseException) -> BaseException:
    """What failed in a group's task group: an episode's timeout if one timed out, else its first
    `EnvironmentFailure`, else its first error. A call that times out may have the server killed,
    and the group's other episodes, on that server, then lose their connections: those losses
    follow from the timeout and often end first, so the timeout names the group's drop."""
    return (
        first_error(exc, EnvironmentTimeout) or first_error(exc, EnvironmentFailure) or first_error(exc) or exc
    )


@dataclass
class EnvironmentStats(SamplingStats):
    episodes: int = 0
    model_turns: int = 0
    truncated_episodes: int = 0
    # The adapter's processes (`EnvironmentAdapter.health`: server or worker pid, restarts).
    environment: dict[str, Any] = field(default_factory=dict)
    # What the environments counted (`TurnEnvironment.metrics`), per key: the last episodes' values
    # (private: `ctl status` shows `vars(stats)` without them).
    _episode_metrics: dict[str, deque] = field(default_factory=dict)

    def step_metrics(self) -> dict[str, Any]:
        # The sampling counters; since this process started, episodes played into groups and their
        # model turns; and the mean of each environment metric over the last ENV_METRIC_WINDOW
        # episodes.
        means = {f"env/{key}": sum(values) / len(values) for key, values in self._episode_metrics.items() if values}
        return {**super().step_metrics(), "episodes": self.episodes, "model_turns": self.model_turns, **means}

    def record(self, environment: TurnEnvironment) -> None:
        measured = getattr(environment, "metrics", None)
        if measured is None:
            return
        for key, value in measured().items():
            self._episode_metrics.setdefault(key, deque(maxlen=ENV_METRIC_WINDOW)).append(float(value))


class EnvironmentSource(SamplingSource):
    kind = "environment"

    def __init__(
        self,
        src: EnvironmentSourceConfig,
        tokenizer,
        policy: Policy,
        adapter: EnvironmentAdapter,
        *,
        max_seq_len: int,
        eval_cfg: EvalConfig,
        engine_wait_s: float,
        dynamic_sampling: DynamicSampling,
        cursor: dict | None = None,
    ) -> None:
        self.src = src
        self.env = src.environment
        self.policy = policy
        self.adapter = adapter
        self.eval_cfg = eval_cfg
        self.engine_wait_s = engine_wait_s
        self.max_tokens = src.max_tokens
        self.turns = ChatTurns(tokenizer)
        self.max_episode_tokens = episode_token_limit(self.env, max_seq_len)
        self.runner = self._runner(src.temperature)
        self.next_index = int((cursor or {}).get("next_index", 0))
        self.stats = EnvironmentStats()
        self.warnings = ThrottledWarnings()
        self.dynamic_sampling = dynamic_sampling

    def _runner(self, temperature: float) -> EpisodeRunner:
        limits = EpisodeLimits(
            temperature=temperature, max_tokens=self.max_tokens, max_turns=self.env.max_turns,
            max_episode_tokens=self.max_episode_tokens, top_p=self.src.top_p,
        )
        return EpisodeRunner(
            self.policy, self.turns, limits, engine_wait_s=self.engine_wait_s,
            environment_timeout_s=self.env.timeout_s + ADAPTER_MARGIN_S,
        )

    def cursor(self) -> dict:
        return {"kind": self.kind, "next_index": self.next_index}

    async def _open(self, index: int, split: Split, count: int) -> tuple[list, list[TurnEnvironment]]:
        """`count` fresh environments of task `index`, opened concurrently (an environment that
        sets up slowly costs one set-up per group, not `count`), and their (common) opening
        messages; what was opened is closed again if opening the rest fails. Failures come out of
        the task group as they do out of a played group (`_failure` names the drop)."""
        bound_s = self.env.start_timeout_s + self.env.timeout_s
        opened: list[tuple[list, TurnEnvironment]] = []

        async def one() -> None:
            try:  # an open may wait for a restarted environment process to come up
                with anyio.fail_after(bound_s):
                    opened.append(await self.adapter.open(index, split))
            except TimeoutError:
                raise EnvironmentTimeout(f"opening task {index} ({split}) took longer than {bound_s:g} s") from None

        try:
            async with anyio.create_task_group() as tg:
                for _ in range(count):
                    tg.start_soon(one)
            if any(messages != opened[0][0] for messages, _ in opened):
                raise EnvironmentFailure(
                    "environment_error",
                    f"task {index} ({split}) opened with different messages for two episodes; an environment "
                    "must give one task per index (seed its reset with the index)",
                )
        except BaseException:
            await self._close([environment for _, environment in opened])
            raise
        return opened[0][0], [environment for _, environment in opened]

    async def _close(self, environments: list[TurnEnvironment]) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.env.timeout_s):
            for environment in environments:
                try:
                    await environment.aclose()
                except Exception as exc:  # noqa: BLE001 — a failed close loses nothing of the group
                    log.warning("environment_close_failed", error=str(exc)[:300])

    async def generate_group(self) -> RolloutGroup | None:
        index = self.next_index
        self.next_index += 1
        environments: list[TurnEnvironment] = []
        try:
            messages, environments = await self._open(index, "train", self.src.group_size)
            group = await self.runner.play_group(
                messages, environments, group_id=f"environment-{index}", source=self.kind
            )
            for environment in environments:
                self.stats.record(environment)
        except Exception as exc:  # noqa: BLE001 — a failed episode drops its group, never the run
            failure = _failure(exc)
            reason = failure.reason if isinstance(failure, EnvironmentFailure) else type(failure).__name__
            self.stats.failed(reason, f"task {index}: {type(failure).__name__}: {failure}")
            self.warnings.warn("episode_failed", reason, task=index, error=str(failure)[:300])
            await anyio.sleep(GENERATION_RETRY_S)
            return None
        finally:
            await self._close(environments)
            self.stats.environment = self.adapter.health()
        self.stats.generated += 1
        self.stats.succeeded()
        self.stats.episodes += len(group.tokens)
        self.stats.sampled_tokens += sum(sum(mask) for mask in group.loss_mask)
        self.stats.truncated_episodes += sum(group.truncated)
        self.stats.model_turns += sum(
            1 for mask in group.loss_mask for t in range(len(mask)) if mask[t] and (t == 0 or not mask[t - 1])
        )
        return group

    async def evaluate(self, size: int, max_tokens: int) -> dict[str, Any]:
        """Greedy episodes of the first `size` held-out tasks (module docstring)."""
        runner = self._runner(0.0)
        version = self.policy.version
        rewards: list[float] = []

        async def one(index: int) -> None:
            environments: list[TurnEnvironment] = []
            try:
                messages, environments = await self._open(index, "eval", 1)
                episode = await runner.play(messages, environments[0])
                rewards.append(float(episode.reward))
            finally:
                await self._close(environments)

        failed = await play_rows(range(size), one, concurrency=EVAL_EPISODES, where=lambda index: f"eval task {index}")
        threshold = self.eval_cfg.correct_threshold
        scored = max(len(rewards), 1)
        return {
            "eval_accuracy": sum(r >= threshold for r in rewards) / scored,
            "eval_reward": sum(rewards) / scored,
            "eval_size": len(rewards),
            "eval_failed": failed,
            "policy_version": version,
        }
