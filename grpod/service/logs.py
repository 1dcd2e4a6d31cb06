"""Logging for a run: structlog events as JSON lines in <run>/grpod.log, readable lines on stderr.

Also `MetricsLog`, the per-step metrics as JSON lines in <run>/metrics.jsonl (what `grpod plot`
and the tests read), optionally mirrored to Weights & Biases (`WandbSink`, `metrics.wandb_project`);
and `LogLimit`, which keeps every log file of the run directory under `run.log_max_mb`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import anyio
import structlog

from grpod.config import run_key

log = structlog.get_logger(__name__)

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class LineFile:
    """A file of lines that only grows by whole lines: grpod.log and metrics.jsonl.

    A write that fails (ENOSPC, EIO) cuts the file back to where its line began and raises, so
    a full disk never leaves half a record that a later line would run into; a last line cut off
    by a kill is removed when the file is opened (and said: `cut`, its bytes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self.cut = 0

    def append(self, text: str) -> None:
        if self._fd is None:
            self._fd = self._open()
        view = memoryview(text.encode())
        written = 0
        try:
            while written < len(view):
                written += os.write(self._fd, view[written:])
        except OSError:
            if written:  # the only writer: the file ends with this line's first `written` bytes
                try:
                    os.ftruncate(self._fd, os.fstat(self._fd).st_size - written)
                except OSError:
                    pass
            raise

    def _open(self) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(fd).st_size
        if size:
            tail = os.pread(fd, min(size, 1 << 20), max(0, size - (1 << 20)))
            if not tail.endswith(b"\n"):
                end = tail.rfind(b"\n")
                keep = size - len(tail) + end + 1 if end >= 0 else (0 if size <= len(tail) else size)
                self.cut = size - keep
                os.ftruncate(fd, keep)
        return fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _Tee:
    """Writes each rendered event to the JSON file and, rendered for humans, to the console.

    The file outlives a full disk: an event it cannot take is counted, not raised into whatever
    was logging (a train step, a stop), and once writes succeed again a `log_lines_lost` event
    says how many and why. The console still shows them."""

    def __init__(self, file: LineFile | None, console: TextIO, console_level: int) -> None:
        self.file = file
        self.console = console
        self.console_level = console_level
        self.pretty = structlog.dev.ConsoleRenderer(colors=False)
        self.lost = 0
        self.lost_error = ""

    def __call__(self, logger: Any, method: str, event: dict[str, Any]) -> str:
        if self.file is not None:
            self._write(event)
        if _LEVELS.get(event.get("level", "info"), logging.INFO) >= self.console_level:
            self.console.write(self.pretty(logger, method, dict(event)) + "\n")
            self.console.flush()
        return ""

    def _write(self, event: dict[str, Any]) -> None:
        line = json.dumps(json_ready(event), default=str) + "\n"
        if self.lost:
            note = {"event": "log_lines_lost", "level": "warning", "lines": self.lost, "error": self.lost_error,
                    "timestamp": event.get("timestamp")}
            line = json.dumps(note) + "\n" + line
        try:
            self.file.append(line)
        except OSError as exc:
            if not self.lost:
                self.console.write(f"grpod: cannot write {self.file.path} ({exc}); events go to the console only "
                                   "until it can\n")
            self.lost += 1
            self.lost_error = f"{type(exc).__name__}: {exc}"
        else:
            self.lost = 0


class _Console:
    """A console stream that outlives its reader. Once a write or flush fails (a pipe whose reader
    exited, a terminal that closed), console output is dropped from then on instead of raising
    into whatever was logging or printing: a daemon started with its output piped to a shell or
    a test that died still stops vLLM and checkpoints. <run>/grpod.log keeps every event."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.lost: str | None = None  # why console output stopped

    def write(self, text: str) -> int:
        if self.lost is None:
            try:
                return self.stream.write(text)
            except (OSError, ValueError) as exc:  # EPIPE, EIO; ValueError: the stream was closed
                self.lost = f"{type(exc).__name__}: {exc}"
        return len(text)

    def flush(self) -> None:
        if self.lost is None:
            try:
                self.stream.flush()
            except (OSError, ValueError) as exc:
                self.lost = f"{type(exc).__name__}: {exc}"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def guard_console() -> None:
    """sys.stdout and sys.stderr as `_Console`s (once): every print and console log line of this
    process then survives a reader that went away."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Console):
            setattr(sys, name, _Console(stream))


class _NullLogger:
    def msg(self, *_: Any, **__: Any) -> None:
        pass

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def configure_logging(run_dir: Path | None, level: str = "info", console: TextIO | None = None) -> None:
    """structlog events: all of them to <run>/grpod.log, those at `level` and above to the console
    (sys.stderr, guarded: `guard_console`)."""
    import os

    guard_console()
    # Saving weights every sync would otherwise draw a progress bar each time. transformers reads
    # this when it is imported (later, in the trainer's thread: importing it here would delay the
    # engines' launch by its ~1.5 s import).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # imported already (trainer ranks under torchrun): too late for the variable
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    file = None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        file = LineFile(run_dir / "grpod.log")  # lives as long as the process
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _Tee(file, console or sys.stderr, _LEVELS[level]),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=lambda *_: _NullLogger(),
        cache_logger_on_first_use=False,
    )


class WandbSink:
    """Step and eval metrics to a W&B run (numbers only, as `<kind>/<name>` at the trainer step).

    The run is named after the run directory and resumed under the same id when the daemon
    resumes, so one training run stays one W&B run across restarts. `wandb` is imported only
    when configured (atroposlib installs it; otherwise `pip install wandb`).
    """

    def __init__(self, project: str, entity: str | None, mode: str, run_dir: Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError(f"metrics.wandb_project = {project!r} needs the wandb package: pip install wandb") from exc
        run_id = "grpod-" + run_key(run_dir)
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            entity=entity,
            mode=mode,
            dir=str(run_dir),
            id=run_id,
            name=run_dir.name,
            resume="allow",
            config=config,
        )

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        numbers = {
            f"{kind}/{key}": value
            for key, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        if numbers:
            self.run.log(numbers, step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() hands the last records to wandb's service process; teardown waits until it
        # has written them and exited (the daemon's exit must not cut them off).
        wandb.teardown()


def json_ready(value: Any) -> Any:
    """`value` with every float that is not finite made None (JSON null): json.dumps would write a
    bare NaN or Infinity, which is no JSON, and every strict reader of the line fails on it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    if not isinstance(value, (str, int, type(None))) and hasattr(value, "__float__"):  # numpy, torch scalars
        return json_ready(float(value))
    return value


LOG_CHECK_S = 10.0  # how often `LogLimit` looks at the files
LOG_KEEP_MAX = 16 << 20  # a cut keeps at most this much of a file's end
CUT_MARK = "=== grpod: cut {cut} bytes from the head of this file (over run.log_max_mb = {limit_mb:g})\n"


def cut_log(path: Path, max_bytes: int) -> int:
    """Cut `path` to its last lines (half of `max_bytes`, at most LOG_KEEP_MAX) when it is over
    `max_bytes`, headed by a line saying so; the bytes cut, 0 if none. The kept lines are written
    over the file's head and the file truncated after them, so the line saying so is always first.
    Its writers (this process, children given it as stdout or stderr) hold it open for appending, so
    what they write next goes to the new end. What they append while the file is cut is moved
    after the kept lines too (read again until nothing new came); only a write landing between
    that last read and the truncation, microseconds, is lost."""
    try:
        size = path.stat().st_size
        if size <= max_bytes:
            return 0
        keep = min(max_bytes // 2, LOG_KEEP_MAX)
        with path.open("r+b") as f:
            f.seek(size - keep)
            tail = f.read(keep)
            # Whole lines only: from the first line that starts in the tail to the last that ends.
            end = size - keep + tail.rfind(b"\n") + 1
            tail = tail[tail.find(b"\n") + 1:tail.rfind(b"\n") + 1]
            kept = CUT_MARK.format(cut=size - len(tail), limit_mb=max_bytes / (1 << 20)).encode() + tail
            f.seek(0)
            f.write(kept)  # over bytes the cut drops: the tail was read from past them
            length = len(kept)
            while True:  # what was appended since (a half line included), after the kept lines
                f.seek(end)
                more = f.read()
                if not more:
                    break
                f.seek(length)
                f.write(more)  # ends before `end + len(more)`: nothing unread is overwritten
                end, length = end + len(more), length + len(more)
            f.truncate(length)
        return size - len(tail)
    except OSError as exc:  # gone, or not ours to cut: the next check tries again
        log.warning("log_cut_failed", path=str(path), error=str(exc))
        return 0


class LogLimit:
    """Every `*.log` file in `directory` (grpod.log, the engines' vllm*.log, rewards.log, the
    environments' logs: what grpod and the processes it starts append to) cut by `cut_log` when
    it grows past `max_bytes`; checked every LOG_CHECK_S in a worker thread. A reward function
    that prints every completion, or an engine that logs every request, cannot fill the disk of a
    run that lasts weeks. metrics.jsonl and rollouts.jsonl are the run's records, not logs: never cut."""

    def __init__(self, directory: Path, max_bytes: int | None) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.cuts = 0

    def check(self) -> None:
        if self.max_bytes is None:
            return
        for path in sorted(self.directory.glob("*.log")):
            cut = cut_log(path, self.max_bytes)
            if cut:
                self.cuts += 1
                log.warning("log_cut", path=str(path), bytes_cut=cut, limit_bytes=self.max_bytes)

    async def run(self) -> None:
        while self.max_bytes is not None:
            await anyio.to_thread.run_sync(self.check)
            await anyio.sleep(LOG_CHECK_S)


class MetricsLog:
    """<run>/metrics.jsonl, one record a line (`LineFile`). Records that cannot be written now (a
    full disk) wait in memory, up to MAX_PENDING, and are written in order by the first write that
    succeeds; the run goes on meanwhile."""

    MAX_PENDING = 100_000

    def __init__(self, path: Path, wandb: WandbSink | None = None) -> None:
        self.path = path
        self.wandb = wandb
        self._file = LineFile(path)
        self._pending: list[str] = []
        self.dropped = 0  # records past MAX_PENDING while the file could not be written

    def write(self, kind: str, step: int, values: dict[str, Any], *, log_step: int | None = None) -> None:
        """Append one record at `step`; W&B logs it at `log_step` (default `step`: W&B keeps
        only steps in increasing order)."""
        record = {**values, "kind": kind, "step": step, "time": time.time()}
        self._pending.append(json.dumps(json_ready(record), default=float) + "\n")
        if len(self._pending) > self.MAX_PENDING:
            del self._pending[0]
            self.dropped += 1
        self._flush()
        if self.wandb is not None:
            self.wandb.log(kind, step if log_step is None else log_step, values)

    def _flush(self) -> None:
        waited = len(self._pending) - 1
        try:
            if not self.path.parent.is_dir():
                self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file.append("".join(self._pending))
        except OSError as exc:
            if not waited:
                log.warning("metrics_write_failed", path=str(self.path), error=f"{type(exc).__name__}: {exc}",
                            note="records wait in memory until the file can be written")
            return
        if self._file.cut:
            log.warning("metrics_line_cut", path=str(self.path), bytes=self._file.cut,
                        note="the last line was cut off (a kill or a full disk while it was written)")
            self._file.cut = 0
        if waited:
            log.info("metrics_written_late", path=str(self.path), records=waited, dropped=self.dropped)
        self._pending.clear()

    def close(self) -> None:
        self._file.close()
        if self.wandb is not None:
            wandb, self.wandb = self.wandb, None
            wandb.close()

    def read(self) -> list[dict[str, Any]]:
        return read_metrics(self.path) if self.path.exists() else []


class MetricsFileError(ValueError):
    """A metrics.jsonl line that is not a JSON record (the message names the file and line)."""


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl (`path` is the file or its run directory), in order. A
    last line without its newline (a write cut off by a kill) is left out; any other line that
    is not JSON raises MetricsFileError naming it. The one reader: the plot, the summary, the
    benchmarks and the tests use it."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    text = path.read_text()
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # unterminated: the write was cut off
                break
            raise MetricsFileError(f"{path}:{number}: not a JSON line") from None
    return records


# A message repeated on every group (a reward function's error, a dropped episode, a rejected
# group) is written once per this many seconds, with a count of those held back.
REPEAT_EVERY_S = 30.0


class RepeatThrottle:
    """How often one kind of repeated message is written: the first of each key, then at most one
    per `every_s` (REPEAT_EVERY_S), the one shown saying how many of its key were held back since
    the last.

    A reward function that raises on every group (or an environment that fails every episode)
    must not write a line, or a traceback, per group: the reader needs the first in full and a
    count, not ten thousand copies."""

    def __init__(self, every_s: float = REPEAT_EVERY_S) -> None:
        self.every_s = every_s
        self._seen: dict[Any, tuple[float, int]] = {}

    def admit(self, key: Any, now: float) -> int | None:
        """None: hold this one back (counted); else write it, and say the count returned (how many
        of `key` were held back since the last written, 0 for none)."""
        last, held = self._seen.get(key, (None, 0))
        if last is not None and now - last < self.every_s:
            self._seen[key] = (last, held + 1)
            return None
        self._seen[key] = (now, 0)
        return held

    def drain(self) -> dict[Any, int]:
        """The keys with some held back since their last written one, and how many (for a closing
        line); counted as said, so a second call does not repeat them."""
        held = {key: count for key, (_, count) in self._seen.items() if count}
        self._seen.update({key: (self._seen[key][0], 0) for key in held})
        return held
