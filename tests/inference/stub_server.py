"""A stand-in server process for the failures a real vLLM cannot produce on demand.

`python stub_server.py --port P [--exit-code N] [--no-health] [--ignore-term] [--orphan]`:
serves `GET /health` on 127.0.0.1:P (echoing `GRPOD_LAUNCH_TOKEN` when set, as grpod's server does),
and the weight-version routes a launch calls (`POST /update_weight_version`, `GET /weight_info`),
or exits with code N after a message, or never serves;
`--ignore-term` makes it (and its helper) ignore SIGTERM, as a vLLM waiting on open connections
does; `--orphan` forks a helper in the same process group that outlives the server, as vLLM's
EngineCore and Worker do when the API server alone dies; `--linger-on-term S` makes SIGTERM end
the main thread alone while another thread finishes S seconds later with exit code 0: for those S
seconds the leader is a zombie that cannot be reaped yet, as a vLLM server whose last thread is
still exiting (releasing its memory) is.
"""

import argparse
import ctypes
import platform
import http.server
import json
import os
import signal
import sys
import tempfile
import threading
import time

# exit(2), which ends the calling thread only (os._exit ends them all: exit_group).
SYS_EXIT = {"x86_64": 60, "aarch64": 93}.get(platform.machine())


class Health(http.server.BaseHTTPRequestHandler):
    weight_version = None

    def _answer(self, status, body=None):
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        # Echo the launch token as grpod's server does (a foreign stub runs without one).
        if os.environ.get("GRPOD_LAUNCH_TOKEN"):
            self.send_header("x-grpod-launch", os.environ["GRPOD_LAUNCH_TOKEN"])
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/weight_info":
            self._answer(200, {"weight_version": Health.weight_version})
        else:
            self._answer(200 if self.path == "/health" else 404)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/update_weight_version":
            Health.weight_version = json.loads(body)["new_version"]
            self._answer(200)
        else:
            self._answer(404)

    def log_message(self, *args):
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--exit-code", type=int)
    parser.add_argument("--no-health", action="store_true")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--orphan", action="store_true")
    parser.add_argument("--linger-on-term", type=float)
    args = parser.parse_args()
    print(f"stub server pid {os.getpid()} port {args.port}", flush=True)
    # Litter the temp dir as vLLM does with its rendezvous files and IPC sockets.
    scratch = tempfile.gettempdir()
    with open(os.path.join(scratch, "vllm_dist_stub"), "w") as f:
        f.write("rendezvous")
    print(f"stub tmpdir {scratch}", flush=True)
    if args.exit_code is not None:
        print("stub failure: model directory has no config.json", flush=True)
        sys.exit(args.exit_code)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.linger_on_term is not None:

        def linger(*_):
            def finish():
                time.sleep(args.linger_on_term)
                os._exit(0)

            threading.Thread(target=finish).start()
            ctypes.CDLL(None).syscall(SYS_EXIT, 0)

        signal.signal(signal.SIGTERM, linger)
    if args.orphan and os.fork() == 0:
        print(f"stub helper pid {os.getpid()}", flush=True)
        while True:
            time.sleep(60)
    if args.no_health:
        while True:
            time.sleep(60)
    http.server.HTTPServer(("127.0.0.1", args.port), Health).serve_forever()


if __name__ == "__main__":
    main()
