"""grpod's vLLM server: `python -m grpod.inference.server <vLLM OpenAI server arguments>`.

Runs vLLM's stock OpenAI-compatible server in this process and adds, without forking vLLM or
editing installed files:

- `POST /generate` in the shape Atropos environments (`server_type=vllm`) call, so they work
  unchanged against a grpod-managed vLLM. Request: `{"prompt": {"prompt_token_ids": [...]},
  "logprobs": 0, "n", "max_tokens", "temperature", "top_p", "seed", ...}` (other keys are vLLM
  sampling parameters). Answer, one list entry per output: `text`, `finish_reasons`, `token_ids`,
  `logprobs` (per generated token, a list holding one dict `{"<token id>": logprob}`, sampled token
  first), plus `prompt_token_ids`, and `prompt_logprobs` when asked for. The request is served by
  vLLM's own `/v1/completions` handler, so both routes sample and score identically.
- `POST /grpod/generate_model` `{"model": name | null}`: the served model `/generate` uses when a
  request names none. Atropos environments never name one, so in LoRA modes the bridge points
  this at the current adapter; otherwise they would sample from the base model.
- `POST /grpod/pause?mode=keep|abort`: the engine's scheduler pause, the fence of a weight
  update. Stock `/pause` runs the same engine call (`pause_scheduler`: once it returns no forward
  pass runs until `/resume`) and then sleeps a fixed 20 ms so outputs of aborted requests are
  delivered first, which is most of its cost on CPU; `keep` aborts nothing, so grpod's fence skips
  the sleep.
- `POST /grpod/resume` `{"version": N}`: the end of a fence in one request — prefix-cache reset,
  weight version N (vLLM's `update_weight_version`), resume — the same engine calls as
  `/reset_prefix_cache`, `/update_weight_version` and `/resume`, in that order, without two
  extra round trips.
- The launch token: every HTTP answer, `/health` and errors included, carries the header
  `x-grpod-launch` with the value of `GRPOD_LAUNCH_TOKEN`, a random token grpod sets for each
  launch. grpod's client checks it on every answer, so readiness, health and the alignment probe
  prove they reached the server this grpod launched, never another process on the same port.
- An API-key check on every route but `/health` when the server has a key (`--api-key` or
  `VLLM_API_KEY`): vLLM's own check guards only `/v1`, `/v2`, `/inference` and `/cohere`, which
  leaves the dev routes (`/pause`, `/collective_rpc`, ...) and `/generate` open.
- Options in full only: the parser takes no abbreviation (`--hos` is not `--host`), behind grpod's
  own refusal of the options it decides (`grpod.config.reserved_vllm_option`).
- Stops with the daemon that launched it, killed or OOM-killed too: SIGTERM to its process group,
  SIGKILL after `inference.stop_grace_s` (`grpod.service.children.stop_group_with_parent`), so a
  killed daemon leaves no vLLM holding the port, the memory and the accelerator. (An agent's
  engines serve on while their agent restarts.)

Route paths, the launch-token header and the `/generate` translation live in the vLLM-free
`grpod.inference.routes`; this module serves them (`router`).

The hook is vLLM's app factory: `build_app` is wrapped where vLLM's launcher looks it up, so every
stock route, middleware and the engine lifecycle stay vLLM's. `/health` stays vLLM's, which answers
503 once the engine is dead.
"""

import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from grpod.inference.routes import (
    FORK_ENGINE_CORE_ENV,
    GENERATE_MODEL_ROUTE,
    GENERATE_ROUTE,
    LAUNCH_HEADER,
    LAUNCH_TOKEN_ENV,
    PAUSE_ROUTE,
    RESUME_ROUTE,
    UNGUARDED_ROUTES,
    GenerateRequestError,
    atropos_response,
    completion_request_body,
)
from grpod.service.children import stop_group_with_parent


def _bad_request(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": 400}}, status_code=400)


# grpod's routes, added to vLLM's app by `add_grpod_routes`.
router = APIRouter()


async def _serve_generate(body: dict[str, Any], raw_request: Request) -> JSONResponse:
    from pydantic import ValidationError
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionRequest,
        CompletionResponse,
    )
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    try:
        default_model = raw_request.app.state.grpod_generate_model
        request = CompletionRequest.model_validate(completion_request_body(body, default_model))
    except GenerateRequestError as exc:
        return _bad_request(str(exc))
    except ValidationError as exc:
        return _bad_request(f"invalid /generate request: {exc}")
    handler = raw_request.app.state.openai_serving_completion
    if handler is None:
        return _bad_request("the served model does not support completions")
    result = await handler.create_completion(request, raw_request)
    if isinstance(result, ErrorResponse):
        return JSONResponse(result.model_dump(), status_code=result.error.code)
    if not isinstance(result, CompletionResponse):
        return _bad_request("unexpected streaming answer")
    return JSONResponse(atropos_response(result.model_dump(), body))


@router.post(GENERATE_ROUTE)
async def generate(raw_request: Request) -> Any:
    from vllm.entrypoints.serve.utils.api_utils import with_cancellation

    try:
        body = await raw_request.json()
    except ValueError as exc:
        return _bad_request(f"body is not JSON: {exc}")
    return await with_cancellation(_serve_generate)(body, raw_request)


@router.post(GENERATE_MODEL_ROUTE)
async def set_generate_model(raw_request: Request) -> Any:
    try:
        model = (await raw_request.json())["model"]
    except (ValueError, KeyError, TypeError):
        return _bad_request('expected {"model": "<served model or adapter name>" | null}')
    if model is not None and not isinstance(model, str):
        return _bad_request(f'"model" must be a string or null, not {model!r}')
    raw_request.app.state.grpod_generate_model = model
    return JSONResponse({"model": model})


@router.post(PAUSE_ROUTE)
async def pause(raw_request: Request) -> Any:
    mode = raw_request.query_params.get("mode", "keep")
    if mode not in ("keep", "abort"):
        return _bad_request(f"mode must be 'keep' or 'abort', not {mode!r}")
    await raw_request.app.state.engine_client.engine_core.pause_scheduler_async(mode=mode, clear_cache=True)
    return JSONResponse({"status": "paused"})


@router.post(RESUME_ROUTE)
async def resume(raw_request: Request) -> Any:
    try:
        version = (await raw_request.json())["version"]
    except (ValueError, KeyError, TypeError):
        return _bad_request('expected {"version": <integer weight version>}')
    if not isinstance(version, int) or isinstance(version, bool):
        return _bad_request(f'"version" must be an integer, not {version!r}')
    engine = raw_request.app.state.engine_client
    reset = await engine.reset_prefix_cache()
    await engine.update_weight_version(str(version))
    await engine.resume_generation()
    return JSONResponse({"prefix_cache_reset": bool(reset), "version": version})


def add_grpod_routes(app: Any, args: Any) -> None:
    """Add grpod's routes and, when the server has an API key, the all-routes key check; then
    the launch token on every answer."""
    from starlette.datastructures import Headers
    from vllm import envs
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    app.state.grpod_generate_model = None
    app.include_router(router)

    class KeyOnEveryRoute(AuthenticationMiddleware):
        def __call__(self, scope, receive, send):
            if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
                path = scope["path"].removeprefix(scope.get("root_path", ""))
                if path not in UNGUARDED_ROUTES and not self.verify_token(Headers(scope=scope)):
                    return JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return self.app(scope, receive, send)

    tokens = [key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]
    if tokens:
        _wrap_outermost(app, lambda inner: KeyOnEveryRoute(inner, tokens=tokens))
    launch_token = os.environ.get(LAUNCH_TOKEN_ENV)
    if launch_token:
        # Wrapped last, so outermost: 401s and vLLM's own errors carry it too.
        _wrap_outermost(app, lambda inner: EchoLaunchToken(inner, token=launch_token))


def _wrap_outermost(app: Any, wrap: Any) -> None:
    """Put `wrap(stack)` around the app's whole middleware stack. vLLM's app may already have
    built its stack (Starlette's `add_middleware` then refuses), so the builder is wrapped and the
    stack dropped: Starlette rebuilds it, wrapped, on the first request."""
    build = app.build_middleware_stack
    app.build_middleware_stack = lambda: wrap(build())
    app.middleware_stack = None


class EchoLaunchToken:
    """ASGI middleware: the launch token as a header on every HTTP answer."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.header = (LAUNCH_HEADER.encode(), token.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_token(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_token)


# While vLLM's worker and engine wait for their next message on a shared-memory queue, they spin
# for a second after each message with sched_yield (vLLM's SpinCondition), which keeps a whole core
# busy as long as requests keep coming. On a CPU machine that core is the trainer's: measured on
# the embedded default (2 cores), the worker used 0.185 CPU-s per 0.19 s step; 0.089 with the nap.
# A nap of NAP_S between checks adds at most that much latency to a forward pass of ~ms.
NAP_S = 1e-4


def _nap_while_waiting() -> None:
    """On CPU, replace the waiting spin's `sched_yield` with a NAP_S sleep (same loop, same
    1 s window before vLLM parks the reader on its socket; only the spin's CPU use changes).
    Runs in every vLLM process: the API server and, through `__mp_main__`, its spawned children."""
    import time

    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        shm_broadcast.sched_yield = lambda: time.sleep(NAP_S)


def _fork_engine_core() -> None:
    """Start EngineCore by fork, inheriting this process' imports, instead of spawn.

    vLLM's CPU platform forces spawn for every child process so that a Worker process reads its
    OpenMP binding (VLLM_CPU_OMP_THREADS_BIND) on import. With the worker inside EngineCore
    ("uni") there is no such process, and the spawned EngineCore only imports vLLM and torch again:
    ~9 of the ~26 s a tiny model's server took to answer /health here (17 s by fork, measured).
    grpod asks for it only there (`FORK_ENGINE_CORE_ENV`, set by `process.executor_env`); vLLM forks EngineCore on GPU machines
    by default from the same place when CUDA is not initialised.
    """
    if os.environ.get(FORK_ENGINE_CORE_ENV) != "1":
        return
    import multiprocessing

    import vllm.v1.engine.utils as engine_utils

    engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")
    os.register_at_fork(after_in_child=_release_inherited_listeners)


def _release_inherited_listeners() -> None:
    """In a forked child: point what keeps the API server's socket alive at /dev/null.

    vLLM binds the API server's socket before it starts EngineCore (and listens on it after), so a
    forked EngineCore holds it too, and holds the server's io_uring instance (the event loop's),
    whose pending accept also keeps the socket listening. Were the API server killed, the port
    would then go on accepting connections nobody answers, and grpod's requests would wait out
    their timeout (case 2 of the fault suite: 120 s) instead of being refused at once. Each such
    inherited descriptor (an unconnected TCP socket, an io_uring instance) is replaced by
    /dev/null in this process only: the parent's are untouched (dup2 changes one process' table;
    a shutdown through a socket object would stop the parent's socket too). EngineCore uses
    neither: it talks to the API server over its own ZMQ sockets.
    """
    import socket

    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue  # the listing's own descriptor, closed by now
            release = target == "anon_inode:[io_uring]"
            if target.startswith("socket:"):
                probe = socket.socket(fileno=fd)
                try:
                    release = probe.family in (socket.AF_INET, socket.AF_INET6) and probe.type == socket.SOCK_STREAM
                    if release:
                        probe.getpeername()  # a connected socket: not a server's
                        release = False
                except OSError:
                    pass  # ENOTCONN: bound (or listening), never connected
                finally:
                    probe.detach()  # the descriptor stays this process'; only its target changes
            if release:
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _options_in_full() -> None:
    """vLLM's server parser without argparse's abbreviations: `--hos 0.0.0.0` is an unknown option,
    not --host. grpod refuses its reserved options in any spelling before a launch
    (`grpod.config.reserved_vllm_option`); this is the second lock, on the parser itself. The
    parser is built where vLLM's launcher looks `make_arg_parser` up, as `build_app` is wrapped."""
    import vllm.entrypoints.launchers.cli_args as cli_args

    stock_make_arg_parser = cli_args.make_arg_parser

    def make_arg_parser(parser: Any) -> Any:
        parser = stock_make_arg_parser(parser)
        parser.allow_abbrev = False  # read by argparse at parse time
        return parser

    cli_args.make_arg_parser = make_arg_parser


def main() -> None:
    stop_group_with_parent()
    import vllm.entrypoints.launchers.api_server.entry as launcher

    _nap_while_waiting()
    _fork_engine_core()
    _options_in_full()

    stock_build_app = launcher.build_app

    def build_app(args: Any, *a: Any, **kw: Any) -> Any:
        app = stock_build_app(args, *a, **kw)
        add_grpod_routes(app, args)
        return app

    launcher.build_app = build_app
    launcher.main()


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":
    _nap_while_waiting()
