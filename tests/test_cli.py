"""The `grpod` command line: what it accepts."""

from grpod.daemon.desk import OperatorDesk


def test_the_ctl_subcommand_accepts_exactly_the_desks_commands():
    from grpod.cli import _parser

    ctl = next(a for a in _parser()._subparsers._group_actions[0].choices["ctl"]._actions if a.dest == "cmd")
    assert tuple(ctl.choices) == OperatorDesk.commands()


def _check(tmp_path, *overrides):
    """`grpod check-config` of the shipped file with `overrides`, as a user runs it."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, "-m", "grpod", "check-config", str(root / "etc" / "grpod.toml"),
         "--set", f"model.path={str(tmp_path / 'model')!r}", *(arg for o in overrides for arg in ("--set", o))],
        capture_output=True, text=True, timeout=120, cwd=root,
    )


def test_check_config_refuses_what_this_host_cannot_run_naming_the_key(tmp_path):
    """Each of these passed `check-config` and failed `grpod start` with a traceback or an OSError
    naming neither key nor path, some only after vLLM had started."""
    import socket

    (tmp_path / "afile").write_text("x")
    (tmp_path / "notamodel").mkdir()
    (tmp_path / "notamodel" / "README").write_text("x")
    live = tmp_path / "live.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(live))
    listener.listen(1)
    taken = socket.create_server(("127.0.0.1", 0))
    taken_port = taken.getsockname()[1]
    cases = [
        (f"run.dir={str(tmp_path / 'afile')!r}", "run.dir: ", "exists and is not a directory"),
        ("run.dir=''", "run.dir", "an empty path: name one"),
        (f"run.dir={str(tmp_path / ('x' * 110))!r}", "run.dir (the socket is <run.dir>/grpod.sock)", "over a Unix socket path's 107"),
        ("control.socket=''", "control.socket", "an empty path: name one"),
        (f"control.socket={str(live)!r}", "control.socket", "in use by another running grpod"),
        (f"model.path={str(tmp_path / 'afile')!r}", "model.path", "is a file, not an HF model directory"),
        (f"model.path={str(tmp_path / 'notamodel')!r}", "model.path", "holds no HF model"),
        ("train.device='cuda:7'", "train.device", "CUDA"),
        ("inference.kv_cache_bytes='banana'", "inference.kv_cache_bytes", "banana"),
        ("inference.kv_cache_bytes='1.5G'", "inference.kv_cache_bytes", "1.5G"),
        # Found at the first sync, minutes into the run, before.
        (f"bridge={{mode='broadcast', port={taken_port}}}", "bridge.port", f"127.0.0.1:{taken_port} is taken"),
        ("bridge={mode='broadcast', port=29999, host='192.0.2.1'}", "bridge.host", "not an address of this machine"),
        # The start failed with exit 1 after the trainer and vLLM had loaded (a bare OSError for the metrics).
        (f"metrics.prometheus_port={taken_port}", "metrics.prometheus_port", f"127.0.0.1:{taken_port} is taken"),
        (f"inference={{port={taken_port - 1}, engines=2}}", "inference.port", f"127.0.0.1:{taken_port} is taken by another process "
                                                               "(engine 1 would fail to start)"),
        # Every evaluation of the run failed, each a warning, and the run exited 0.
        ("eval.size=200", "eval.size = 200", "the builtin task holds out 156 problems"),
    ]
    try:
        for override, key, why in cases:
            proc = _check(tmp_path, f"run.dir={str(tmp_path / 'run')!r}", override)
            assert proc.returncode == 2 and key in proc.stderr and why in proc.stderr, (override, proc.stderr)
            assert "Traceback" not in proc.stderr, proc.stderr
    finally:
        listener.close()
        taken.close()
    replay = _check(tmp_path, f"run.dir={str(tmp_path / 'run')!r}", "source.kind='replay'",
                    f"source.replay_path={str(tmp_path / 'gone.jsonl')!r}")
    assert replay.returncode == 2 and "source.replay_path: " in replay.stderr and "gone.jsonl" in replay.stderr
    fine = _check(tmp_path, f"run.dir={str(tmp_path / 'run')!r}", "inference.kv_cache_bytes='1.5g'")
    assert fine.returncode == 0, fine.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "model").exists(), "check-config creates nothing"


def test_ctl_refuses_a_timeout_that_is_not_a_positive_number(capsys):
    import pytest

    from grpod.cli import main

    for bad in ("-1", "nan", "0", "inf", "soon"):
        with pytest.raises(SystemExit) as exited:
            main(["ctl", "status", "--socket", "/nonexistent.sock", "--timeout", bad])
        assert exited.value.code == 2
        assert "--timeout" in capsys.readouterr().err


def test_ctl_output_into_a_closed_pipe_is_no_error(tmp_path):
    """`grpod ctl ... | head -1` printed a BrokenPipeError traceback when head left early."""
    import subprocess
    import sys

    script = (
        "import sys, grpod.cli as cli\n"
        "cli.cmd_check_config = lambda args: [print('line', i) for i in range(200000)] and 0\n"
        "sys.exit(cli.main(['check-config', 'x.toml']))\n"
    )
    proc = subprocess.run(f"{sys.executable} -c \"{script}\" | head -1", shell=True, capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout == "line 0\n" and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_a_sighup_before_the_daemon_is_up_does_not_end_grpod_start(tmp_path):
    """Python's default for SIGHUP ends the process: `systemctl reload` in the first second of
    `grpod start` killed it. Until the daemon's own handler is in place the signal is ignored."""
    import subprocess
    import sys

    args = ["start", "--set", f"run.dir={str(tmp_path / 'run')!r}", "--set", f"model.path={str(tmp_path / 'model')!r}"]
    script = (
        "import os, signal, sys, grpod.daemon.supervisor as sup\n"
        "def run_daemon(cfg, **kw):\n"
        "    os.kill(os.getpid(), signal.SIGHUP)\n"
        "    return 0\n"
        "sup.run_daemon = run_daemon\n"
        "import grpod.cli as cli\n"
        f"sys.exit(cli.main({args!r}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)


def test_check_config_exits_2_on_a_reserved_vllm_option_or_a_bad_environment_argument(tmp_path):
    """Both passed `check-config`: the one then let vLLM listen on 0.0.0.0 without a key, the other
    made every group's scores NaN ("no step trained")."""
    run_dir = f"run.dir={str(tmp_path / 'run')!r}"
    cases = [
        (["inference.extra_args=['--hos', '0.0.0.0']"],
         "inference.extra_args: Value error, '--hos' sets vLLM's --host, which grpod decides (inference.host)"),
        (["source.kind='environment'", "source.environment.args={tool_bonus=nan}"],
         "adapter 'calculator') cannot start: ValueError: source.environment.args.tool_bonus = nan: expected a finite"),
    ]
    for overrides, message in cases:
        proc = _check(tmp_path, run_dir, *overrides)
        assert proc.returncode == 2 and message in proc.stderr, (overrides, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr


def test_ctl_stop_returns_once_the_daemon_has_exited(tmp_path):
    """`grpod ctl stop` used to return at the request: a `grpod start` right after found the run
    directory still held ("stop that one first (grpod ctl stop ...)"), and systemd took ExecStop's
    return for the service stopped. A process with the real desk and control server stands in
    for the daemon, and takes 1.5 s to stop once asked; it stays unreaped (a zombie) until the
    test reaps it, as a daemon does when its parent is slow to."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sock = tmp_path / "grpod.sock"
    script = textwrap.dedent(f"""
        import anyio
        from pathlib import Path
        from grpod.config import load_config
        from grpod.daemon.control import ControlServer
        from grpod.daemon.desk import OperatorDesk
        from grpod.daemon.progress import RunProgress

        async def main():
            cfg = load_config(None, ["run.dir={str(tmp_path / 'run')!r}"])
            desk = OperatorDesk(cfg, RunProgress(steps=10))
            server = ControlServer(Path({str(sock)!r}), desk.handlers(), request_timeout_s=10)
            async with anyio.create_task_group() as tg:
                await tg.start(server.serve)
                print("listening", flush=True)
                with anyio.fail_after(60):
                    await desk.stopping.wait()
                await anyio.sleep(1.5)  # the shutdown: checkpoint, evaluation, engines stopped
                tg.cancel_scope.cancel()

        anyio.run(main)
    """)
    daemon = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        for line in daemon.stdout:  # its log lines, then the marker
            if line.strip() == "listening":
                break
        refused = subprocess.run([sys.executable, "-m", "grpod", "ctl", "set", "train.lr=-1", "--socket", str(sock)],
                                 cwd=root, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 3 and refused.stderr.startswith("grpod ctl set: ") and refused.stderr.count("set:") == 1, \
            refused.stderr  # was "grpod ctl set: set: ctl set: ..."
        stop = subprocess.run([sys.executable, "-m", "grpod", "ctl", "stop", "--socket", str(sock), "--timeout", "30"],
                              cwd=root, capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
        assert daemon.poll() is not None, "ctl stop returned while the daemon still ran"
        assert f"pid: {daemon.pid}" in stop.stdout and "exited: True" in stop.stdout, stop.stdout
    finally:
        daemon.kill()
        daemon.wait(timeout=30)


def test_ctl_names_the_socket_a_daemon_started_with_set_run_dir_listens_on(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "elsewhere"
    found = subprocess.run([sys.executable, "-m", "grpod", "ctl", "status", "--config", str(root / "etc" / "grpod.toml"),
                            "--set", f"run.dir={str(run)!r}"], cwd=root, capture_output=True, text=True, timeout=60)
    assert found.returncode == 3 and f"no grpod is listening on {run / 'grpod.sock'}" in found.stderr, found.stderr
    bare = subprocess.run([sys.executable, "-m", "grpod", "ctl", "status", "--config", str(root / "etc" / "grpod.toml")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert bare.returncode == 3 and "needs the same --set here" in bare.stderr, bare.stderr


def test_plot_of_a_directory_that_is_no_run_says_so_without_a_traceback(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "grpod", "plot", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "is " in proc.stderr and "grpod run directory" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_ctl_set_without_a_value_says_what_it_expects_naming_no_flag_the_user_did_not_give(capsys):
    from grpod.cli import main

    assert main(["ctl", "set", "train.lr", "--socket", "/nonexistent/grpod.sock"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpod ctl set: 'train.lr': expected KEY=VALUE") and "--set" not in err, err


def test_check_config_exits_2_on_an_environment_whose_first_task_cannot_fit(tmp_path):
    """It said ok, and `grpod start` then dropped every group as prompt_too_long, a warning per
    episode, 0 steps, forever. Checked with model.path's tokenizer as the episodes tokenize it (no
    weights are loaded, none launched)."""
    from grpod.models.tiny import build_config, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path / "model")
    build_config(len(tokenizer)).save_pretrained(tmp_path / "model")
    environment = [f"run.dir={str(tmp_path / 'run')!r}", "source.kind='environment'"]
    proc = _check(tmp_path, *environment, "model.max_seq_len=256")
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert ("adapter 'calculator'): task 0 does not fit: the episode's opening is" in proc.stderr
            and "no room for a model turn within 256" in proc.stderr
            and "raise model.max_seq_len" in proc.stderr and "Traceback" not in proc.stderr), proc.stderr
    proc = _check(tmp_path, *environment, "model.max_seq_len=1024", "source.environment.max_episode_tokens=200")
    assert proc.returncode == 2 and "raise source.environment.max_episode_tokens" in proc.stderr, proc.stderr
    proc = _check(tmp_path, *environment, "model.max_seq_len=1024")
    assert proc.returncode == 0 and ": ok (" in proc.stdout, proc.stderr
