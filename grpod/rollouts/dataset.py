"""The dataset rollout source: the user's prompts from a local file, scored by reward functions.

`source.dataset.path` is a JSONL (.jsonl / .json), Parquet or CSV file, each value as the file
wrote it (`grpod.rollouts.dataset_files`; the format comes from the suffix). Each row has its prompt in the string
column `prompt_column` or the chat column `messages_column` (a list of {role, content}); every
other column is handed to the reward functions (`grpod.rollouts.rewards`). The whole file is read,
checked and tokenized once at start-up: a bad row (no prompt, an empty one, a value of the wrong
type, a prompt too long for model.max_seq_len) is an error naming the file, the row (1-based, in
file order, a CSV header not counted) and the column, before any generation starts.

Prompt text: with a chat template (`tokenizer.chat_template`) the prompt is rendered as one user
turn after `system_prompt` (a messages row is rendered as is, with `system_prompt` put first when
the row has no system turn of its own), with the assistant turn opened. Without one, the text is
`system_prompt`, a blank line and the prompt (messages: their contents, blank-line separated).

Order: epoch `e` visits every row once, shuffled by `random.Random(f"{shuffle_seed}:{e}")`. The
cursor is {kind, epoch, position}, so a resumed run continues with exactly the prompts the stopped
one would have drawn next (groups in flight at the checkpoint are not regenerated, as with the
builtin source). With `epochs = 0` the passes never end and `train.steps` ends the run; with
`epochs = N` the source is exhausted after N passes and the run ends once the queue is used up.

Active sampling (`rest_epochs = R`): a row whose group carried no learning signal (the trainer's
own test, `grpod.rollouts.signal.carries_signal`: always solved or never solved) is skipped in the
next R epochs, then drawn again. The resting rows ride in the cursor ("resting": row index -> the
epoch it returns), so a resumed run skips the same rows.

Difficulty levels (`curriculum`, `grpod.rollouts.curriculum`): rows carry an integer level and are
drawn from one level's endless stream at a time, the level following the running pass rate; the
curriculum's state rides in the cursor ("curriculum"), and its group ids read `dataset-L<level>-<row>`.

Each group is `group_size` completions of one prompt in one vLLM request (as the builtin source
does). A group whose generation or reward failed is dropped with its reason in `stats.drop_reasons`
(`ctl status`: source.drop_reasons) and logged; the run goes on. Each function's mean reward rides
in `RolloutGroup.extra["reward_means"]` and reaches metrics.jsonl as `reward/<name>` per step.

Evaluation (`eval.dataset`): the first `eval.size` rows, pass@1 by greedy decoding
(`eval_accuracy`) and, with `eval.k > 0`, mean@k (`eval_mean_at_k`): the mean correctness of `k`
samples at `source.temperature`. A completion is correct when its combined reward is at least
`eval.correct_threshold`; a completion whose reward failed counts as incorrect
(`eval_reward_failures`).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog

from grpod.config import CurriculumConfig, DatasetConfig, DatasetSourceConfig, EvalConfig, GrpodConfig
from grpod.inference.policy import Policy
from grpod.rollouts.curriculum import Curriculum
from grpod.rollouts.dataset_files import DatasetError, read_rows, row_where
from grpod.rollouts.dynamic_sampling import DynamicSampling
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.held_out import play_rows
from grpod.rollouts.rewards import (
    CALL_KEYWORDS,
    EXTRA_KEY,
    LOGGED_KEY,
    UNSCORABLE,
    GroupRewards,
    RewardFailure,
    RewardFunction,
    TrainerState,
    missing_file,
    reward_functions,
)
from grpod.rollouts.sampling_source import SamplingSource, SamplingStats, ThrottledWarnings
from grpod.rollouts.signal import carries_signal
from grpod.rollouts.scoring import PLACEHOLDER_COMPLETION, RewardCall, RewardScorer

log = structlog.get_logger(__name__)

# Reward functions get these keywords; a column of the same name could not be passed.
RESERVED_COLUMNS = CALL_KEYWORDS


@dataclass(frozen=True)
class DatasetRow:
    """A checked row: its prompt as messages (a string prompt is one user turn) and its columns."""

    row: int  # 0-based position in the file
    messages: list[dict[str, str]]
    chat: bool  # a `messages` row (TRL's conversational format) rather than a string prompt
    columns: dict[str, Any]

    def reward_prompt(self, system_prompt: str | None) -> Any:
        """`prompts[i]` as TRL gives it: the string prompt, or the messages the model saw."""
        if not self.chat:
            return self.messages[0]["content"]
        return _with_system(self.messages, system_prompt)


@dataclass(frozen=True)
class DatasetItem:
    row: int  # 0-based position in the file
    prompt_ids: list[int]
    prompt_text: str
    columns: dict[str, Any]
    chat: bool = False
    reward_prompt: Any = None


# `ctl status` shows each reward function's mean over this many of the latest groups.
STATUS_GROUPS = 64


@dataclass
class DatasetStats(SamplingStats):
    epoch: int = 0
    # Active sampling (source.dataset.rest_epochs): draws skipped because their row was resting,
    # and the rows resting now.
    rested: int = 0
    resting: int = 0
    reward_s: float = 0.0
    # Per function: its mean reward over the latest STATUS_GROUPS groups (None left out).
    reward_means: dict[str, float] = field(default_factory=dict)
    # The reward workers: size, calls, failures by reason, replaced workers, mean call time.
    reward_pool: dict[str, Any] | None = None
    # source.dataset.curriculum: the level, its window's pass rate, moves and draws per level.
    curriculum: dict[str, Any] | None = None
    _recent: dict[str, deque] = field(default_factory=dict, repr=False)

    def step_metrics(self) -> dict[str, Any]:
        level = {"curriculum_level": self.curriculum["level"]} if self.curriculum else {}
        return {**super().step_metrics(), **level}

    def scored(self, means: dict[str, float]) -> None:
        for name, mean in means.items():
            recent = self._recent.setdefault(name, deque(maxlen=STATUS_GROUPS))
            recent.append(mean)
            self.reward_means[name] = round(sum(recent) / len(recent), 6)


def _with_system(messages: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    if system_prompt is not None and not (messages and messages[0]["role"] == "system"):
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


def _render(tokenizer, messages: list[dict[str, str]], system_prompt: str | None) -> str:
    messages = _with_system(messages, system_prompt)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n\n".join(m["content"] for m in messages)


class _RowProblem(ValueError):
    """What is wrong with one value of a row (load_rows adds the file, row, line and column)."""

    def __init__(self, message: str, column: str | None = None) -> None:
        super().__init__(message)
        self.column = column


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _RowProblem(f"expected a non-empty list of {{role, content}} messages, got {value!r:.80}")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise _RowProblem(f"message {i} must be {{role: str, content: str}}, got {message!r:.80}")
        if not message["content"].strip():
            raise _RowProblem(f"message {i} has empty content")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _prompt_messages(value: Any, chat: bool) -> list[dict[str, str]]:
    if value is None:
        raise _RowProblem("missing")
    if chat:
        return _messages(value)
    if not isinstance(value, str):
        raise _RowProblem(f"expected a string, got {type(value).__name__} {value!r:.80}")
    if not value.strip():
        raise _RowProblem("empty prompt")
    return [{"role": "user", "content": value}]


def _keyed_rows(key: str, path: Path, dcfg: DatasetConfig, functions: list[RewardFunction]) -> list[DatasetRow]:
    """`load_rows` of the file the config's `key` names; its errors name the key first (the
    training file or the held-out one)."""
    try:
        return load_rows(path, dcfg, functions)
    except DatasetError as exc:
        raise DatasetError(f"{key}: {exc}") from None


def load_rows(path: Path, dcfg: DatasetConfig, functions: list[RewardFunction]) -> list[DatasetRow]:
    """Read and check every row of `path` (no tokenizer needed: this runs before anything is
    launched); a DatasetError names the first bad one."""
    path = Path(path)
    rows = read_rows(path)
    if not rows:
        raise DatasetError(f"{path}: the dataset has no rows")
    names = list(rows[0])
    if dcfg.messages_column in names and dcfg.prompt_column in names:
        raise DatasetError(
            f"{path}: has both a {dcfg.prompt_column!r} and a {dcfg.messages_column!r} column; keep one "
            "(or point source.dataset.prompt_column / messages_column elsewhere)"
        )
    if dcfg.messages_column in names:
        column, chat = dcfg.messages_column, True
    elif dcfg.prompt_column in names:
        column, chat = dcfg.prompt_column, False
    else:
        raise DatasetError(
            f"{path}: no prompt column: expected {dcfg.prompt_column!r} (a string) or {dcfg.messages_column!r} "
            f"(a list of {{role, content}}); the columns are {names}. source.dataset.prompt_column / "
            "messages_column name other columns"
        )
    clashing = [name for name in names if name in RESERVED_COLUMNS]
    if clashing:
        raise DatasetError(
            f"{path}: column {clashing[0]!r} clashes with a reward function argument "
            f"({', '.join(RESERVED_COLUMNS)}); rename it"
        )
    needed = sorted({c for f in functions for c in f.needs_columns})
    for name in needed:
        if name not in names:
            users = [f.name for f in functions if name in f.needs_columns]
            raise DatasetError(f"{path}: reward functions {users} need a {name!r} column; the columns are {names}")
    checked = []
    for index, row in enumerate(rows):
        try:
            messages = _prompt_messages(row.get(column), chat)
            for name in needed:
                if row.get(name) is None:
                    raise _RowProblem("missing (reward functions need it)", name)
        except _RowProblem as exc:
            raise DatasetError(f"{path}: {row_where(path, index)}, column {exc.column or column!r}: {exc}") from None
        columns = {k: v for k, v in row.items() if k != column}
        checked.append(DatasetRow(row=index, messages=messages, chat=chat, columns=columns))
    return checked


def check_levels(rows: list[DatasetRow], path: Path, curriculum: CurriculumConfig) -> None:
    """The training rows' difficulty levels (source.dataset.curriculum): an integer in every row,
    and the start level among them; a DatasetError names the first bad row. The held-out rows
    need none."""
    column = curriculum.column
    if column not in rows[0].columns:
        raise DatasetError(f"{path}: source.dataset.curriculum needs a {column!r} column (each row's integer "
                           f"difficulty level); the columns are {list(rows[0].columns)}")
    for row in rows:
        value = row.columns.get(column)
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():  # a CSV cell is text
            value = row.columns[column] = int(value)
        if type(value) is not int:
            raise DatasetError(f"{path}: {row_where(path, row.row)}, column {column!r}: expected an integer difficulty level, "
                               f"got {value!r:.80}")
    levels = sorted({row.columns[column] for row in rows})
    if curriculum.start is not None and curriculum.start not in levels:
        raise DatasetError(f"{path}: curriculum.start = {curriculum.start}: no row has that level; the levels are {levels}")


def tokenize_rows(
    rows: list[DatasetRow], path: Path, dcfg: DatasetConfig, tokenizer, max_prompt_tokens: int
) -> list[DatasetItem]:
    """The checked rows rendered (chat template) and tokenized; a prompt too long is a DatasetError."""
    items = []
    for row in rows:
        column = dcfg.messages_column if row.chat else dcfg.prompt_column
        try:
            text = _render(tokenizer, row.messages, dcfg.system_prompt)
        except Exception as exc:  # noqa: BLE001 — jinja2's TemplateError, a template's raise_exception
            raise DatasetError(
                f"{path}: {row_where(path, row.row)}, column {column!r}: the model's chat template refused it "
                f"({type(exc).__name__}: {str(exc)[:200]}); fix the row's messages (roles, their order)"
            ) from None
        ids = list(tokenizer(text, add_special_tokens=not getattr(tokenizer, "chat_template", None)).input_ids)
        if len(ids) > max_prompt_tokens:
            raise DatasetError(
                f"{path}: {row_where(path, row.row)}, column {column!r}: the prompt is {len(ids)} tokens; at most "
                f"{max_prompt_tokens} fit (model.max_seq_len minus source.max_tokens)"
            )
        items.append(DatasetItem(row=row.row, prompt_ids=ids, prompt_text=text, columns=row.columns, chat=row.chat,
                                 reward_prompt=row.reward_prompt(dcfg.system_prompt)))
    return items


@dataclass
class PreparedDataset:
    """A dataset source's inputs, checked before anything is launched: the rows, the held-out
    rows, and the started reward scorer (whose functions passed their start-up call)."""

    rows: list[DatasetRow]
    eval_rows: list[DatasetRow]
    scorer: RewardScorer
    warnings: list[str]
    # The rows rendered and tokenized (`tokenize_rows`); None when the model is not built yet
    # (model.init_if_missing), and the source tokenizes them once it is.
    items: list[DatasetItem] | None = None
    eval_items: list[DatasetItem] | None = None


async def prepare_dataset(cfg: GrpodConfig, *, log_path: Path | None = None, tokenizer=None) -> PreparedDataset:
    """Check a dataset source's inputs: rows, reward functions (imported in the reward workers and
    called once on the first row), prompts (tokenized with `tokenizer`, default model.path's).
    DatasetError / RewardLoadError (ConfigErrors: exit 2) name what is wrong. The caller owns the
    returned scorer (`await prepared.scorer.aclose()`)."""
    dcfg = cfg.source.dataset
    functions = reward_functions(dcfg.rewards)
    for function in functions:  # a missing file is said before a worker starts
        missing_file(function.function)
    rows = await anyio.to_thread.run_sync(_keyed_rows, "source.dataset.path", dcfg.path, dcfg, functions)
    if dcfg.curriculum is not None:
        check_levels(rows, Path(dcfg.path), dcfg.curriculum)
    eval_rows = []
    if cfg.eval.dataset is not None:
        eval_rows = await anyio.to_thread.run_sync(_keyed_rows, "eval.dataset", cfg.eval.dataset, dcfg, functions)
    scorer = RewardScorer(functions, aggregation=dcfg.reward_aggregation, timeout_s=dcfg.reward_timeout_s,
                          workers=dcfg.reward_workers, memory_mb=dcfg.reward_memory_mb, log_path=log_path)
    try:
        await scorer.start()
        # The first training row, and the first held-out one: the evaluation calls the same
        # functions with its own file's columns.
        probes = [(_placeholder_call(rows[0], dcfg, cfg.train.steps),
                   f"{dcfg.path}: row {rows[0].row + 1} (training set)")]
        if eval_rows:
            probes.append((_placeholder_call(eval_rows[0], dcfg, cfg.train.steps),
                           f"{cfg.eval.dataset}: row {eval_rows[0].row + 1} (held-out set)"))
        warnings = await scorer.probe(probes)
        # After the functions (a syntax error is said in seconds): transformers loads the tokenizer.
        # Every prompt as the source will give it: one too long stops check-config and the start
        # before vLLM launches. Model.path's tokenizer is the one every export of the run carries.
        items = eval_items = None
        if tokenizer is None:  # None again while the model is not built yet
            from grpod.rollouts.chat_turns import model_tokenizer

            tokenizer = await anyio.to_thread.run_sync(model_tokenizer, cfg.model.path)
        if tokenizer is not None:
            items, eval_items = await anyio.to_thread.run_sync(
                tokenize_inputs, rows, eval_rows, dcfg, cfg.eval.dataset, tokenizer, cfg.model.max_seq_len - cfg.source.max_tokens)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await scorer.aclose()
        raise
    for warning in warnings:
        log.warning("reward_probe_warning", warning=warning[:1000])
    return PreparedDataset(rows=rows, eval_rows=eval_rows, scorer=scorer, warnings=warnings, items=items,
                           eval_items=eval_items)


def _placeholder_call(first: DatasetRow, dcfg: DatasetConfig, steps: int, n: int = 2) -> RewardCall:
    """The start-up call of every reward function: `first`'s columns, a placeholder completion."""
    return RewardCall(
        prompts=[first.reward_prompt(dcfg.system_prompt)] * n,
        completions=[_completion(PLACEHOLDER_COMPLETION, first.chat)] * n,
        completion_ids=[[0]] * n,
        columns={name: [value] * n for name, value in first.columns.items()},
        trainer_state=TrainerState(max_steps=steps),
    )


def tokenize_inputs(rows: list[DatasetRow], eval_rows: list[DatasetRow], dcfg: DatasetConfig, eval_path: Path | None,
                    tokenizer, max_prompt_tokens: int) -> tuple[list[DatasetItem], list[DatasetItem]]:
    """The training and held-out rows rendered and tokenized (`tokenize_rows`)."""
    items = tokenize_rows(rows, Path(dcfg.path), dcfg, tokenizer, max_prompt_tokens)
    eval_items = tokenize_rows(eval_rows, Path(eval_path), dcfg, tokenizer, max_prompt_tokens) if eval_rows else []
    return items, eval_items


def _completion(text: str, chat: bool) -> Any:
    """`completions[i]` as TRL gives it: the text, or one assistant turn for conversational data."""
    return [{"role": "assistant", "content": text}] if chat else text


def epoch_order(size: int, seed: int, epoch: int) -> list[int]:
    order = list(range(size))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


class DatasetSource(SamplingSource):
    kind = "dataset"

    def __init__(
        self,
        src: DatasetSourceConfig,
        tokenizer,
        policy: Policy,
        *,
        prepared: PreparedDataset,
        eval_cfg: EvalConfig,
        max_seq_len: int,
        engine_wait_s: float,
        dynamic_sampling: DynamicSampling,
        cursor: dict | None = None,
        steps: int = 0,
    ) -> None:
        """`prepared`: the checked rows and the started scorer (`prepare_dataset`); `max_seq_len`
        bounds prompt + completion (`model.max_seq_len`); `engine_wait_s` is how long a request
        waits for an available engine; `steps` is train.steps (`trainer_state.max_steps`)."""
        self.src = src
        self.dcfg = src.dataset
        self.eval_cfg = eval_cfg
        self.tokenizer = tokenizer
        self.policy = policy
        self.engine_wait_s = engine_wait_s
        self.max_tokens = self.src.max_tokens
        self.steps = steps
        self.scorer = prepared.scorer
        self.functions = self.scorer.functions
        self.items, self.eval_items = (
            (prepared.items, prepared.eval_items) if prepared.items is not None  # tokenized while checked
            else tokenize_inputs(prepared.rows, prepared.eval_rows, self.dcfg, eval_cfg.dataset, tokenizer,
                                 max_seq_len - self.max_tokens)
        )
        self.stats = DatasetStats()
        self.epoch = int((cursor or {}).get("epoch", 0))
        self.position = int((cursor or {}).get("position", 0))
        # Active sampling: item index -> the first epoch it is drawn again (its last group had no signal).
        self.resting: dict[int, int] = {int(k): int(v) for k, v in (cursor or {}).get("resting", {}).items()}
        self._order_epoch, self._order = -1, []
        self.curriculum: Curriculum | None = None
        if self.dcfg.curriculum is not None:
            # prepare_dataset checked the levels (check_levels) before anything launched.
            levels = [item.columns[self.dcfg.curriculum.column] for item in self.items]
            self.curriculum = Curriculum(self.dcfg.curriculum, levels, self.dcfg.shuffle_seed,
                                         (cursor or {}).get("curriculum"))
            self.stats.curriculum = self.curriculum.describe()
        self.dynamic_sampling = dynamic_sampling
        self.warnings = ThrottledWarnings()
        log.info("dataset_loaded", path=str(self.dcfg.path), rows=len(self.items), eval_rows=len(self.eval_items),
                 rewards=[f.name for f in self.functions], epoch=self.epoch, position=self.position)

    async def aclose(self) -> None:
        """Stop the reward workers (the daemon's shutdown)."""
        await self.scorer.aclose()

    def cursor(self) -> dict:
        cursor: dict[str, Any] = {"kind": self.kind, "epoch": self.epoch, "position": self.position}
        if self.resting:
            cursor["resting"] = {str(k): v for k, v in sorted(self.resting.items())}
        if self.curriculum is not None:
            cursor["curriculum"] = self.curriculum.cursor()
        return cursor

    def _draw(self) -> tuple[int, int, DatasetItem, int] | None:
        """(epoch, item index, item, resting rows skipped) of the next row of the stream that is not
        resting (advancing the cursor), or None once `epochs` are done. Every row rests for a
        bounded number of epochs, so this ends within rest_epochs + 1 passes. With a curriculum,
        the next row of the current level's stream ("epoch": the level)."""
        if self.curriculum is not None:
            index, level = self.curriculum.draw()
            self.stats.curriculum = self.curriculum.describe()
            return level, index, self.items[index], 0
        if not self.dcfg.rest_epochs and self.resting:  # turned off live: every resting row is back
            self.resting.clear()
            self.stats.resting = 0
        skipped = 0
        while True:
            if self.position >= len(self.items):
                self.epoch, self.position = self.epoch + 1, 0
            self.stats.epoch = self.epoch
            if self.dcfg.epochs and self.epoch >= self.dcfg.epochs:
                self.stats.exhausted = True
                return None
            if self._order_epoch != self.epoch:
                self._order_epoch, self._order = self.epoch, epoch_order(len(self.items), self.dcfg.shuffle_seed, self.epoch)
            index = self._order[self.position]
            self.position += 1
            if self.resting.get(index, 0) <= self.epoch:
                return self.epoch, index, self.items[index], skipped
            skipped += 1

    def _rest(self, index: int, epoch: int, group: RolloutGroup) -> None:
        """Active sampling: the row of a group without signal skips the next rest_epochs epochs;
        one with signal is in play."""
        if not self.dcfg.rest_epochs:
            return
        ds = self.dynamic_sampling
        if carries_signal(group, ds.advantages, ds.budget):
            self.resting.pop(index, None)
        else:
            self.resting[index] = epoch + 1 + self.dcfg.rest_epochs
        self.stats.resting = sum(1 for back in self.resting.values() if back > self.epoch)

    def peek_rows(self, count: int) -> list[int]:
        """The file rows the next `count` draws will give (without drawing them)."""
        if self.curriculum is not None:
            return [self.items[index].row for index in self.curriculum.peek(count)]
        saved = (self.epoch, self.position, self.stats.exhausted)
        rows = []
        for _ in range(count):
            drawn = self._draw()
            if drawn is None:
                break
            rows.append(drawn[2].row)
        self.epoch, self.position, self.stats.exhausted = saved
        return rows

    def passes(self) -> float:
        """Rows drawn so far over the rows of the set (`trainer_state.epoch`, fractional as TRL's):
        the epoch and the position in it, or under a curriculum, every level's draws."""
        if self.curriculum is not None:
            return sum(self.curriculum.draws.values()) / len(self.items)
        return self.epoch + self.position / len(self.items)

    async def score(self, item: DatasetItem, completions, version: int | None = None) -> GroupRewards:
        """Rewards of `completions` of `item`, called as TRL calls them; raises RewardFailure."""
        n = len(completions)
        call = RewardCall(
            prompts=[item.reward_prompt if item.reward_prompt is not None else item.prompt_text] * n,
            completions=[_completion(c.text, item.chat) for c in completions],
            completion_ids=[list(c.token_ids) for c in completions],
            columns={name: [value] * n for name, value in item.columns.items()},
            trainer_state=TrainerState(
                global_step=self.policy.trainer_step, max_steps=self.steps,
                policy_version=self.policy.version if version is None else version, epoch=self.passes(),
            ),
        )
        started = anyio.current_time()
        try:
            scored = await self.scorer.score(call)
        finally:
            self.stats.reward_s += anyio.current_time() - started
            self.stats.reward_pool = self.scorer.describe()
        return scored

    async def generate_group(self) -> RolloutGroup | None:
        drawn = self._draw()
        if drawn is None:
            return None
        epoch, index, item, skipped = drawn
        self.stats.rested += skipped
        sampled = await self.sample(item.prompt_ids, row=item.row + 1)
        if sampled is None:
            return None
        try:
            scored = await self.score(item, sampled.completions, sampled.version)
        except RewardFailure as failure:
            self.stats.failed(failure.reason, f"reward {failure.function}: {failure.detail}")
            self.warnings.warn("reward_failed", failure.reason, function=failure.function,
                               error=failure.detail[:500], path=str(self.dcfg.path), row=item.row + 1)
            return None
        self.stats.scored(scored.means)
        unscorable = scored.unscorable
        if all(unscorable):
            # A failure like a reward that raises: a function that answers None for everything
            # must reach the source alarm and source.fail_after_s, or the run never ends.
            error = "every reward function returned None for every completion"
            self.stats.failed(UNSCORABLE, f"row {item.row + 1}: {error}")
            self.warnings.warn("reward_failed", UNSCORABLE, error=error, path=str(self.dcfg.path), row=item.row + 1)
            return None
        scorable = [s for s in scored.scores if s is not None]
        # An unscorable completion's placeholder score is never read: `unscorable` leaves it out.
        scores = [scorable[0] if s is None else s for s in scored.scores]
        overrides = [{"unscorable": True} if u else {} for u in unscorable] if any(unscorable) else None
        group_id = f"dataset-L{epoch}-{item.row}" if self.curriculum is not None else f"dataset-{epoch}-{item.row}"
        group = self.group(item.prompt_ids, sampled, scores, group_id,
                           extra={EXTRA_KEY: scored.means, LOGGED_KEY: scored.logged}, overrides=overrides)
        self._rest(index, epoch, group)
        if self.curriculum is not None:
            threshold = self.eval_cfg.correct_threshold
            # Over the scored completions only, as the trainer counts them: an unscorable one
            # (every function answered None) is no failure to move the level down for.
            passed = [s >= threshold for s in scorable]
            self.curriculum.record(epoch, sum(passed) / len(passed))
            self.stats.curriculum = self.curriculum.describe()
        return group

    async def evaluate(self, size: int, max_tokens: int) -> dict:
        """pass@1 (greedy) and mean@k on the first `size` rows of eval.dataset."""
        if not self.eval_items:
            raise DatasetError("evaluation needs eval.dataset (a held-out split with the training set's columns)")
        items = self.eval_items[:size]
        k, threshold = self.eval_cfg.k, self.eval_cfg.correct_threshold
        max_tokens = max(max_tokens, self.max_tokens)
        greedy_correct, sampled_correct, failures = 0, 0, 0
        version = self.policy.version

        async def correct(item: DatasetItem, completions) -> int:
            nonlocal failures
            try:
                scored = await self.score(item, completions)
            except RewardFailure as failure:
                failures += 1
                self.warnings.warn("eval_reward_failed", failure.reason, function=failure.function, row=item.row + 1,
                                   error=failure.detail[:500])
                return 0
            return sum(score is not None and score >= threshold for score in scored.scores)

        async def one(item: DatasetItem) -> None:
            nonlocal greedy_correct, sampled_correct
            async with self.policy.engine(self.engine_wait_s) as lease:
                greedy = await lease.client.generate(item.prompt_ids, n=1, max_tokens=max_tokens, temperature=0.0,
                                                     model=lease.model)
                sampled = []
                if k:
                    sampled = await lease.client.generate(item.prompt_ids, n=k, max_tokens=max_tokens,
                                                          temperature=self.src.temperature, model=lease.model)
            # Awaited before the `+=`: `x += await f()` reads x before awaiting and loses updates.
            greedy_ok = await correct(item, greedy)
            sampled_ok = await correct(item, sampled) if k else 0
            greedy_correct += greedy_ok
            sampled_correct += sampled_ok

        failed = await play_rows(items, one, where=lambda item: f"eval row {item.row + 1}")
        size = max(len(items) - failed, 1)
        result = {
            "eval_accuracy": greedy_correct / size,
            "eval_size": len(items) - failed,
            "eval_failed": failed,
            "eval_reward_failures": failures,
            "policy_version": version,
        }
        if k:
            result |= {"eval_mean_at_k": sampled_correct / (size * k), "eval_k": k}
        return result
