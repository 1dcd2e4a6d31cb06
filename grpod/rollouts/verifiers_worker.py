"""The verifiers worker: a child process of `VerifiersAdapter` that plays a verifiers environment's
side of grpod's episodes, in the verifiers venv (`make verifiers`; it cannot share grpod's).

Run as `<verifiers venv>/bin/python path/to/verifiers_worker.py '<json spec>'` with the spec
{"name", "args", "eval_args", "path", "memory_mb"} (its memory cap, `cap_memory`). It imports only the standard library, verifiers and
`grpod.rollouts.reward_worker` (stdlib only: the frame format and `protocol_channel`, i.e.
PR_SET_PDEATHSIG, are shared with the reward workers). Frames both ways are an 8-byte length and a body: a pickle of plain data from
the daemon, JSON back. First frame: ("ready", env id) or ("load_error", why); then requests
(call id, op, *args), served concurrently, each answered by its id (`_serve`).

What verifiers 0.4.0 (`verifiers.v1`) calls an environment, and how it is played here. There is
no `vf.load_environment(name, **kwargs)` in 0.4.0: an environment is a `Taskset` package (a module
whose `__all__` exports one `vf.Taskset` subclass, optionally one `vf.Env` subclass) found by id:
- loading: `vf.resolve_env_config({"taskset": {"id": name, **args}})` narrows the config to the
  taskset's own `TasksetConfig` subclass (`utils/loaders.py: resolve_env_config`,
  `env_config_type`), and `vf.load_environment(config)` builds the `Env` (`environment_class`:
  the package's exported `Env`, else `SingleAgentEnv`; `Env.__init__` loads the taskset);
- tasks: iterating `env.taskset` (`Taskset.__iter__`) yields `Task`s with `data.idx` set; task
  `index` is the index-th (modulo the size of a finite taskset). Its opening is
  `data.system_prompt` and `data.prompt` (a string or messages);
- turns: `Env.run(task, agents)` is the environment's control flow. A multi-turn env opens
  `agents.<seat>.interaction(task)` and calls `await interaction.turn(message)` (the user turn
  that follows the model's reply; a bare `turn()` takes a prompted task's opening reply), reads
  `segment.last_reply`, and stops on `segment.terminated` (`agent.py: Interaction.turn`,
  `Segment`; the pattern of `tasksets/textarena`). A plain taskset's `SingleAgentEnv.run` is
  `agents.agent.run(task)`: one model reply. Here the agents are grpod's stand-ins
  (`_PolicySeat`): `turn(message)` hands `message` to grpod as what follows the model's turn and
  waits for grpod's next model turn; grpod never runs a verifiers harness or model client — it
  samples every model turn itself, token in / token out. An episode grpod ends early (its
  max_turns) gets a terminated segment, as verifiers' own limits give;
- rewards: when `run` returns, each trace is scored by `Task.score(trace)` (the task's
  `@vf.reward`/`@vf.metric` methods, without a runtime), then `Env.finalize(task, episode)`
  (cross-trace judgement: `record_reward` on the traces); the reward is the policy seat's
  `Trace.reward` (the sum of score x weight).

Only what `run` does with the seat's interaction is supported: harnesses, runtimes, MCP
toolsets and model clients are never started (a text tool call is the env's to parse, as the
example `etc/examples/agent-envs/vf_calculator` does). Every call into user code that raises
becomes an ("error", where, what) reply, never the end of the process.
"""

from __future__ import annotations

import sys

# Run by file path, this directory is first on the import path, and grpod's `rollouts/signal.py`
# would shadow the standard library's `signal` (imported by asyncio): put grpod's checkout there
# instead, before any other import (`grpod.rollouts.reward_worker` is imported from it below).
# Imported as a module (grpod's tests of `TaskStream`), the import path is left as it is.
if __name__ == "__main__":
    sys.path[0] = __file__.rsplit("/", 3)[0]

import asyncio
import collections
import itertools
import json
import os
import traceback
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Iterator

from grpod.rollouts.reward_worker import protocol_channel, read_request, write_reply  # noqa: E402
from grpod.service.children import cap_memory  # noqa: E402

# How long the worker waits for an episode's env code to reach its next turn, or to finish,
# before it answers anyway; the daemon's own bound (source.environment.timeout_s) is what a user
# sees: it cancels the call first (the "cancel" request).
STEP_WAIT_S = 3600.0


class UserCodeError(Exception):
    """The environment's code raised; the message says where and what."""


def _text(content: Any) -> str:
    import verifiers.v1 as vf

    return content if isinstance(content, str) else vf.types.content_text(content)


def _wire(messages: Any) -> list[dict[str, str]]:
    """verifiers messages (typed, or wire dicts) as grpod's plain {"role", "content"} dicts."""
    out = []
    for message in messages:
        if isinstance(message, dict):
            out.append({"role": str(message["role"]), "content": _text(message.get("content"))})
        else:
            out.append({"role": message.role, "content": _text(message.content)})
    return out


class _Episode:
    """One episode: the env's `run` as an asyncio task, and the hand-over of turns with grpod."""

    def __init__(self, env: Any, task: Any) -> None:
        self.env, self.task = env, task
        self.events: asyncio.Queue = asyncio.Queue()  # ("turn", messages) | ("done", reward) | ("error", why)
        self.reply: asyncio.Future | None = None
        self.ended = False  # grpod ended it: every further turn is terminated
        self.reward: float | None = None
        self.runner: asyncio.Task | None = None
        self.opened_by: int | None = None  # the daemon's call id of the open that started it

    async def play(self) -> None:
        import verifiers.v1 as vf

        episode = vf.Episode(env=vf.EnvInfo(id=self.env.config.env_id),
                             task=vf.TraceTask(type=type(self.task).__name__, data=self.task.data))
        seat = _PolicySeat(self, episode)
        try:
            try:
                await self.env.setup(_Seats(seat))
                await self.env.run(self.task, _Seats(seat))
            except Exception as exc:  # noqa: BLE001 — user code
                raise UserCodeError(f"{type(self.env).__name__}.run() raised {exc!r}") from exc
            if not episode.traces:
                raise UserCodeError(f"{type(self.env).__name__}.run() played no turn with the policy")
            for trace in episode.traces:
                try:
                    await self.task.score(trace)
                except Exception as exc:  # noqa: BLE001 — the task's @vf.reward methods
                    raise UserCodeError(f"{type(self.task).__name__}.score() raised {exc!r}") from exc
            try:
                await self.env.finalize(self.task, episode)
            except Exception as exc:  # noqa: BLE001 — user code
                raise UserCodeError(f"{type(self.env).__name__}.finalize() raised {exc!r}") from exc
            self.reward = float(sum(trace.reward for trace in episode.traces))
            self.events.put_nowait(("done", None))
        except UserCodeError as exc:
            cause = "".join(traceback.format_exception(exc.__cause__ or exc)[-3:])
            self.events.put_nowait(("error", f"{exc}\n{cause}"[:4000]))


class _Interaction:
    """What an env's `run` holds as `interaction`: `turn`, `trace` (verifiers' `Interaction`)."""

    def __init__(self, episode: _Episode, trace: Any) -> None:
        self.episode, self.trace = episode, trace

    def _add(self, message: Any, sampled: bool = False) -> None:
        import verifiers.v1 as vf

        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(vf.MessageNode(parent=parent, message=message, sampled=sampled))

    async def turn(self, message: Any = None) -> Any:
        import verifiers.v1 as vf
        from verifiers.v1.agent import Segment
        from verifiers.v1.dialects import parse_message

        episode = self.episode
        if episode.ended:
            return Segment(messages=[], terminated=True)
        if isinstance(message, str):
            messages = [vf.UserMessage(content=message)]
        else:
            messages = [parse_message(m) if isinstance(m, dict) else m for m in message or []]
        for item in messages:
            self._add(item)
        episode.reply = asyncio.get_running_loop().create_future()
        episode.events.put_nowait(("turn", _wire(messages)))
        text = await episode.reply
        if text is None:  # grpod ended the episode (its max_turns)
            episode.ended = True
            return Segment(messages=[], terminated=True)
        reply = vf.AssistantMessage(content=text)
        self._add(reply, sampled=True)
        return Segment(messages=[reply])


class _PolicySeat:
    """The agent seat grpod's policy plays (verifiers' `Agent`: `interaction`, `run`)."""

    def __init__(self, episode: _Episode, record: Any) -> None:
        self.episode, self.record = episode, record
        self.trainable = True

    def _trace(self, task: Any) -> Any:
        import verifiers.v1 as vf

        trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data),
                         agent=vf.AgentInfo(config=vf.AgentConfig()))
        return trace

    @asynccontextmanager
    async def interaction(self, task: Any):
        trace = self._trace(task)
        interaction = _Interaction(self.episode, trace)
        for message in _opening(task):
            interaction._add(message)
        try:
            yield interaction
        finally:
            trace.is_completed = trace.ok = True
            self.record.traces.append(trace)

    async def run(self, task: Any) -> Any:
        """A plain taskset's one reply (`SingleAgentEnv.run`)."""
        async with self.interaction(task) as interaction:
            await interaction.turn()
        return interaction.trace


class _Seats:
    """`Agents`: every seat name is the policy's (grpod trains one policy)."""

    def __init__(self, seat: _PolicySeat) -> None:
        self._seat = seat

    def __getattr__(self, name: str) -> _PolicySeat:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.__dict__["_seat"]


def _opening(task: Any) -> list[Any]:
    import verifiers.v1 as vf
    from verifiers.v1.dialects import parse_message

    data = task.data
    messages: list[Any] = []
    if data.system_prompt:
        messages.append(vf.SystemMessage(content=data.system_prompt))
    if isinstance(data.prompt, str):
        messages.append(vf.UserMessage(content=data.prompt))
    elif data.prompt:
        messages.extend(parse_message(m) if isinstance(m, dict) else m for m in data.prompt)
    return messages


_END = object()  # the end of a taskset's iteration; a task not held


class TaskStream:
    """One split's tasks in the order `iter(taskset)` yields them, read by index.

    Task `index` is the index-th task, modulo the taskset's length once a finite taskset has been
    seen to end. A verifiers taskset may be an infinite generator and a run's index grows without
    end, so only the first `FIRST` tasks (evaluation without an eval split reads tasks
    0..eval.size-1 of the train stream) and the last `WINDOW` tasks walked are held: memory is
    bounded whatever the index. An index behind both is reached by iterating the taskset again from
    its start (`iter(taskset)`; a verifiers `Taskset` starts afresh each time); a taskset that is a
    one-shot iterator cannot be, and says so.

    A fresh worker (a resume, a restart) walks from task 0 to the run's index: the walk yields to
    the event loop every `YIELD_EVERY` tasks, so the worker's other calls go on and a cancel (the
    daemon's timeout) is confirmed within milliseconds; the position reached is kept, and the next
    call goes on from there. Walks are one at a time (a lock), since they share the iterator.
    """

    FIRST = 1024
    WINDOW = 1024
    YIELD_EVERY = 256

    def __init__(self, taskset: Any, name: str) -> None:
        self.taskset, self.name = taskset, name
        self.first: list[Any] = []  # tasks 0 .. FIRST-1, as far as walked
        self.recent: collections.deque = collections.deque(maxlen=self.WINDOW)  # tasks position-len(recent) .. position-1
        self.iterator: Iterator[Any] | None = None  # None: start from task 0 at the next walk
        self.position = 0  # the index of the task `iterator` yields next
        self.length: int | None = None  # known once a finite taskset has ended
        self.started = False  # iter(taskset) has been called
        self.walking = asyncio.Lock()

    def held(self) -> int:
        """How many task objects the stream holds (bounded by FIRST + WINDOW)."""
        return len(self.first) + len(self.recent)

    async def task(self, index: int) -> Any:
        """Task `index` (modulo the taskset's length, when it is finite)."""
        task = self._kept(index)
        if task is not _END:
            return task
        async with self.walking:
            while (task := self._kept(index)) is _END:
                if self.length is not None:
                    index %= self.length
                if self.iterator is None or index < self.position - len(self.recent):
                    self._restart(index)
                await self._walk(index)
            return task

    def _kept(self, index: int) -> Any:
        """Task `index` if it is held, else `_END`."""
        if self.length is not None:
            index %= self.length
        if index < len(self.first):
            return self.first[index]
        start = self.position - len(self.recent)
        return self.recent[index - start] if start <= index < self.position else _END

    def _restart(self, index: int) -> None:
        """Iterate the taskset again from task 0 (the first walk starts here too)."""
        iterator = iter(self.taskset)
        if self.started and iterator is self.taskset:
            raise UserCodeError(
                f"task {index} of taskset {self.name!r} is behind the {self.held()} tasks kept, and the taskset "
                f"is a one-shot iterator ({type(self.taskset).__name__}) that cannot be iterated again from its "
                "start: make it an iterable (a vf.Taskset, a list) whose iter() starts over"
            )
        self.iterator, self.position, self.started = iterator, 0, True
        self.recent.clear()

    async def _walk(self, index: int) -> None:
        """Advance until task `index` is held or the taskset ends (its length learned)."""
        while self.position <= index:
            try:
                task = next(self.iterator, _END)
            except BaseException:
                self.iterator = None  # a generator that raised is over: start again next time
                raise
            if task is _END:
                if self.position == 0:
                    raise UserCodeError(f"the taskset {self.name!r} has no tasks")
                self.length, self.iterator = self.position, None
                return
            if self.position == len(self.first) < self.FIRST:
                self.first.append(task)
            self.recent.append(task)
            self.position += 1
            if self.position % self.YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a cancel lands here; the position reached is kept


class EnvironmentHost:
    """The loaded environment, its task streams per split, and the open episodes."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import verifiers.v1 as vf

        for directory in reversed(spec.get("path") or []):
            sys.path.insert(0, directory)
        train = {"taskset": {"id": spec["name"], **(spec.get("args") or {})}}
        self.env = vf.load_environment(vf.resolve_env_config(train))
        envs = {"train": self.env}
        if spec.get("eval_args"):
            evaluation = {"taskset": {"id": spec["name"], **(spec.get("args") or {}), **spec["eval_args"]}}
            envs["eval"] = vf.load_environment(vf.resolve_env_config(evaluation))
        self.envs = envs
        self.tasks = {split: TaskStream(env.taskset, env.config.taskset.id) for split, env in envs.items()}
        self.episodes: dict[int, _Episode] = {}
        self.ids = itertools.count(1)

    async def task(self, index: int, split: str) -> Any:
        """Task `index` of `split` (modulo the size of a finite taskset; `TaskStream`)."""
        return await self.tasks.get(split, self.tasks["train"]).task(index)

    async def opening(self, index: int, split: str) -> list[dict[str, str]]:
        return _wire(_opening(await self.task(index, split)))

    async def open(self, index: int, split: str) -> tuple[int, list[dict[str, str]]]:
        env = self.envs.get(split, self.env)
        episode = _Episode(env, await self.task(index, split))
        key = next(self.ids)
        self.episodes[key] = episode
        episode.runner = asyncio.get_running_loop().create_task(episode.play())
        try:
            kind, value = await episode.events.get()
        except asyncio.CancelledError:  # the daemon gave up on this open: nobody holds the episode
            await self.close(key)
            raise
        if kind == "error":
            await self.close(key)
            raise UserCodeError(value)
        if kind == "done":
            await self.close(key)
            raise UserCodeError(f"{type(env).__name__}.run() ended before the policy's first turn")
        return key, _wire(_opening(episode.task)) + value

    async def respond(self, key: int, text: str) -> list[dict[str, str]] | None:
        episode = self._episode(key)
        if episode.reply is None or episode.reply.done():
            raise UserCodeError("the episode is not waiting for a model turn (it is over)")
        episode.reply.set_result(text)
        kind, value = await episode.events.get()
        if kind == "error":
            raise UserCodeError(value)
        return value if kind == "turn" else None

    async def reward(self, key: int) -> float:
        episode = self._episode(key)
        if episode.reward is None:  # grpod cut it short: end it as verifiers' limits do
            if episode.reply is not None and not episode.reply.done():
                episode.reply.set_result(None)
            while episode.reward is None:
                kind, value = await episode.events.get()
                if kind == "error":
                    raise UserCodeError(value)
                if kind == "turn":  # the env answered a terminated segment with another turn
                    episode.reply.set_result(None)
        return episode.reward

    async def close(self, key: int) -> None:
        episode = self.episodes.pop(key, None)
        if episode is not None and episode.runner is not None and not episode.runner.done():
            episode.runner.cancel()
            await asyncio.gather(episode.runner, return_exceptions=True)

    def _episode(self, key: int) -> _Episode:
        if key not in self.episodes:
            raise UserCodeError(f"no open episode {key} (closed, or the worker restarted)")
        return self.episodes[key]


async def _serve(host: EnvironmentHost, requests: Any, replies: Any) -> None:
    """Answer the daemon's calls concurrently: each request (call id, op, *args) runs as a task of
    its own, and its reply (call id, "ok", result) or (call id, "error", op, why) is written when
    it is done, so one episode's slow turn holds up no other. ("cancel", id) cancels call `id`'s
    task (an episode it was playing is closed; an open that has already answered has its episode
    closed, since its reply reached nobody) and answers once it is gone: the daemon's way out of a
    call past its timeout without killing the worker, and proof that the event loop runs."""
    loop = asyncio.get_running_loop()
    calls = {"task": host.opening, "open": host.open,
             "respond": host.respond, "reward": host.reward, "close": host.close}
    running: dict[int, asyncio.Task] = {}

    async def cancel(target: int) -> None:
        task = running.get(target)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return
        # An open that answered as the daemon gave up on it: nobody holds its episode.
        for key in [key for key, episode in host.episodes.items() if episode.opened_by == target]:
            await host.close(key)

    async def handle(call_id: int, op: str, args: list[Any]) -> None:
        try:
            if op == "cancel":
                result = await cancel(*args)
            else:
                result = calls[op](*args)
                if asyncio.iscoroutine(result):
                    result = await asyncio.wait_for(result, STEP_WAIT_S)
            if op == "open":
                host.episodes[result[0]].opened_by = call_id
            reply: tuple = (call_id, "ok", result)
        except asyncio.CancelledError:
            if op in ("respond", "reward"):  # the episode was mid-turn: it cannot go on
                await host.close(args[0])
            raise
        except UserCodeError as exc:
            reply = (call_id, "error", op, str(exc))
        except Exception as exc:  # noqa: BLE001 — a bug in user code reached outside an episode
            reply = (call_id, "error", op, "".join(traceback.format_exception(exc)[-3:])[:4000])
        finally:
            running.pop(call_id, None)
        try:
            write_reply(replies, reply)
        except (TypeError, ValueError) as exc:  # not JSON, or past the frame limit: the call fails, not the channel
            write_reply(replies, (call_id, "error", op, f"its result cannot be sent to grpod: {exc}"))

    while True:
        message = await loop.run_in_executor(None, read_request, requests)
        if message is None:
            return
        call_id, op, *args = message
        running[call_id] = loop.create_task(handle(call_id, op, args))


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    requests, replies = protocol_channel()
    try:
        if spec.get("memory_mb"):
            cap_memory(spec["memory_mb"])
        host = EnvironmentHost(spec)
    except BaseException as exc:  # noqa: BLE001 — an environment that raises or exits at import
        write_reply(replies, ("load_error", "".join(traceback.format_exception(exc)[-4:])[:4000]))
        return 0
    write_reply(replies, ("ready", host.env.config.env_id))
    asyncio.run(_serve(host, requests, replies))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
