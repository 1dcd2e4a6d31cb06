"""What an environment adapter is: the protocol the environment source (`source.kind =
"environment"`) plays episodes through, and the one failure type every adapter raises.

An adapter is a family of episodes: task `index` of a split is always the same task (same opening
messages), and each `open` gives a fresh `TurnEnvironment` for one episode of it, which the episode
runner (`grpod.rollouts.episode_runner`) steps with the model's turns, token in / token out. An
adapter is an async context manager: entering starts what it needs (an environment server, a worker
process in another venv), each in a process group of its own, waiting for its health check within
`source.environment.start_timeout_s`; leaving stops all of it by process group, on every exit path.
A process an adapter started that dies is restarted by the adapter (its next `open` waits for the
new one), never by the caller.

Failures: everything an environment does wrong — its process died, a call took longer than
`source.environment.timeout_s`, its code raised, it answered something malformed — reaches the
source as `EnvironmentFailure` with a short `reason` (`environment_crash`, `environment_timeout`,
`environment_error`); the source drops the group with that reason and goes on training.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Literal, Protocol

from grpod.rollouts.chat_turns import Message

Split = Literal["train", "eval"]


class EnvironmentFailure(Exception):
    """An environment that failed one episode: `reason` names how (module docstring)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EnvironmentTimeout(EnvironmentFailure):
    """An environment that did not answer in time (`environment_timeout`)."""

    def __init__(self, message: str) -> None:
        super().__init__("environment_timeout", message)


REPLY_ROLES = ("user", "tool")


def finite_number(value: Any) -> float | None:
    """`value` as a float when it is a finite real number, else None (an int past float's range,
    10**400, included). The one test of an environment's reward: every adapter's, and each
    OpenEnv step's."""
    if not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def checked_reply(reply: Any, where: str) -> list[Message]:
    """An environment's reply to a model turn, checked: a list of {role, content} messages, each
    role `user` or `tool` (a reply may not speak as the model or rewrite the system prompt), each
    content a string; else the environment's error, saying what and where."""
    if not isinstance(reply, list) or not reply:
        raise EnvironmentFailure("environment_error", f"{where}: its reply is {type(reply).__name__} {reply!r:.80}, "
                                 "expected a non-empty list of {role, content} messages (or None: the episode is over)")
    for i, message in enumerate(reply):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise EnvironmentFailure("environment_error", f"{where}: reply message {i} is {message!r:.120}, "
                                     "expected {role, content} with a string content")
        if message.get("role") not in REPLY_ROLES:
            raise EnvironmentFailure("environment_error", f"{where}: reply message {i} has role "
                                     f"{message.get('role')!r:.40}; a reply speaks as {' or '.join(REPLY_ROLES)}")
    return [{"role": m["role"], "content": m["content"]} for m in reply]


class TurnEnvironment(Protocol):
    """One episode's environment (a fresh one per episode: it may keep the episode's state)."""

    async def respond(self, text: str) -> list[Message] | None:
        """The messages that follow the model turn whose text is `text` (role `tool` or `user`),
        or None: the episode is over."""

    async def reward(self) -> float:
        """The episode's final reward, asked once when it is over."""

    async def aclose(self) -> None:
        """Release the episode (its session on a server); called once, whatever happened."""

    # Optional: `metrics() -> dict[str, float]`, what the finished episode counted (tool calls,
    # calls that failed to parse...); the source reports each key's mean as `env/<key>`.


class EnvironmentAdapter(Protocol):
    """A family of episodes (module docstring)."""

    name: str

    async def __aenter__(self) -> EnvironmentAdapter: ...

    async def __aexit__(self, *exc_info: object) -> None: ...

    async def open(self, index: int, split: Split) -> tuple[list[Message], TurnEnvironment]:
        """A fresh environment for one episode of task `index` of `split`, and the episode's opening
        messages (the same for every episode of that task)."""

    def health(self) -> dict[str, Any]:
        """What `ctl status` shows of the adapter (its processes, restarts); {} if nothing."""
