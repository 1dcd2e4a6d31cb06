"""A reward worker: one child process of the daemon's `RewardPool` that runs user reward code.

Run as `python -m grpod.rollouts.reward_worker '<json list of function specs>' <memory_mb>`. It
imports every function once, says so (or why not) in its first frame, then answers calls one at a
time until its standard input closes. Frames both ways are an 8-byte big-endian length and a
body: a pickle from the daemon (a group's keyword arguments: any column values), JSON back (the
daemon never unpickles what user code's process wrote: checked floats, None and strings only).
A call that raised answers what and where (the deepest frame of the user's code, for grpod.log)
and its traceback, which the pool writes to the worker's log (`RewardPool`: throttled).

What the process does so that user code cannot hurt the daemon or the protocol:
- the protocol runs on private copies of fds 0 and 1; fd 1 then points at fd 2, so a `print` in a
  reward function goes to the worker's log, never into a frame;
- `PR_SET_PDEATHSIG(SIGKILL)`: the kernel kills the worker if the daemon dies, even mid-call;
- `RLIMIT_DATA` of `memory_mb`: an allocation past the cap raises MemoryError in the user's code
  (reported as `reward_memory`; the pool then replaces the worker);
- every `BaseException` from user code (SystemExit, KeyboardInterrupt included) is a failed call,
  not the end of the process; `os._exit`, a segfault, a hang are seen and handled by the parent;
- math-verify's own timeouts work here (they use SIGALRM, which needs the main thread: every call
  runs on the worker's main thread).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import pickle
import struct
import sys
import sysconfig
import traceback
from functools import cache
from typing import Any, BinaryIO

from grpod.service.children import cap_memory, die_with_parent

HEADER = struct.Struct(">Q")
# A frame larger than this is a broken protocol, not a reward (a group's kwargs are kilobytes).
MAX_FRAME = 256 * 1024 * 1024


def write_reply(stream: BinaryIO, message: Any) -> None:
    """One reply frame; ValueError (nothing written) for one past MAX_FRAME, which the reader
    would take for a broken protocol, TypeError for one that is not JSON."""
    data = json.dumps(message).encode()
    if len(data) > MAX_FRAME:
        raise ValueError(f"a reply of {len(data)} bytes, over the {MAX_FRAME >> 20} MiB a frame may carry")
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def read_request(stream: BinaryIO) -> Any | None:
    """The next request from the daemon, or None at end of input."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes")
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


# A traceback sent back is cut to its last this many characters (its deepest frames and the error).
MAX_TRACEBACK = 64 * 1024
# What an exception's repr is cut to in the one-line description (grpod.log keeps 500: room for where).
MAX_REPR = 200


@cache
def _library_dirs() -> tuple[str, ...]:
    """Where the interpreter's standard library and installed packages live: not the user's code."""
    paths = sysconfig.get_paths()
    return tuple({os.path.join(paths[key], "") for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths})


def raised_at(exc: BaseException) -> traceback.FrameSummary | None:
    """The deepest frame of the user's code that `exc` passed through: below its caller (the first
    frame), the deepest one outside the standard library and installed packages, else the deepest
    (a KeyError in `json` is reported where the user's code called it)."""
    frames = traceback.extract_tb(exc.__traceback__)[1:]
    own = [frame for frame in frames if not frame.filename.startswith(_library_dirs())]
    return (own or frames or [None])[-1]


def describe_raise(exc: BaseException) -> str:
    """One line: what was raised and where, "raised KeyError('answer') at /p/rewards.py:12 in lookup"."""
    text = repr(exc)
    text = text if len(text) <= MAX_REPR else text[:MAX_REPR] + "..."
    frame = raised_at(exc)
    return f"raised {text}" + (f" at {frame.filename}:{frame.lineno} in {frame.name}" if frame is not None else "")


def format_raise(exc: BaseException) -> str:
    """`exc`'s traceback as Python prints it, from below its caller (the first frame, the worker's
    own), its last MAX_TRACEBACK characters."""
    try:
        below = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        return "".join(traceback.TracebackException(type(exc), exc, below).format())[-MAX_TRACEBACK:]
    except Exception as failure:  # noqa: BLE001 — a __repr__ or __str__ of user code that raises
        return f"(its traceback could not be formatted: {failure!r})\n"


class _Calls:
    """The loaded functions and how one call of one of them is made."""

    def __init__(self, functions: list[Any]) -> None:
        self.functions = functions
        self.loop = asyncio.new_event_loop()

    def call(self, index: int, kwargs: dict[str, Any]) -> tuple:
        from grpod.rollouts.rewards import RewardFailure, checked_rewards

        name, fn = self.functions[index]
        logged: dict[str, list[float]] = {}

        def log_metric(key: str, value: float) -> None:
            logged.setdefault(str(key), []).append(float(value))

        def log_extra(column: str, values: list) -> None:  # TRL's completions table: nothing to show here
            del column, values

        n = len(kwargs["completions"])
        try:
            returned = fn(**kwargs, log_metric=log_metric, log_extra=log_extra)
            if inspect.isawaitable(returned):
                returned = self.loop.run_until_complete(returned)
            rewards = checked_rewards(name, returned, n)
        except RewardFailure as failure:
            return ("failed", failure.reason, failure.detail, "", "")
        except MemoryError as exc:
            return ("failed", "reward_memory", f"{describe_raise(exc)}: over reward_memory_mb", type(exc).__name__,
                    format_raise(exc))
        except BaseException as exc:  # noqa: BLE001 — SystemExit and KeyboardInterrupt from user code included
            return ("failed", "reward_error", describe_raise(exc), type(exc).__name__, format_raise(exc))
        metrics = {key: sum(values) / len(values) for key, values in logged.items() if values}
        return ("ok", rewards, metrics)


def _load(specs: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    from grpod.rollouts.rewards import resolve_function

    return [(spec["name"], resolve_function(spec["function"], spec.get("pattern"))) for spec in specs]


def protocol_channel():
    """A worker's start: die with the daemon, keep stdin/stdout as the private request and reply
    streams, and point fd 0 at /dev/null and fd 1 (and `print`) at stderr, the log."""
    die_with_parent()
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return requests, replies


def main(argv: list[str]) -> int:
    specs, memory_mb = json.loads(argv[0]), int(argv[1])
    requests, replies = protocol_channel()
    try:
        cap_memory(memory_mb)
        calls = _Calls(_load(specs))
    except BaseException as exc:  # noqa: BLE001 — a module that raises or exits at import
        write_reply(replies, ("load_error", str(exc) or repr(exc)))
        return 0
    write_reply(replies, ("ready", [name for name, _ in calls.functions]))
    while True:
        message = read_request(requests)
        if message is None:
            return 0
        _, index, kwargs = message
        write_reply(replies, calls.call(index, kwargs))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
