"""The console of a daemon whose reader went away: a dead pipe costs console lines, never the
caller (logging or printing), and the event log still gets every event."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpod.service.logs import LineFile, MetricsLog, RepeatThrottle, _Console, read_metrics


def test_a_console_whose_reader_exited_drops_its_lines_and_says_why(tmp_path):
    read, write = os.pipe()
    stream = os.fdopen(write, "w")
    os.close(read)
    console = _Console(stream)
    assert console.write("x" * 100_000) == 100_000  # more than a pipe buffers: the write fails
    console.flush()
    assert console.lost is not None and "BrokenPipeError" in console.lost
    assert console.write("later\n") == 6 and console.fileno() == stream.fileno()


def test_a_process_logging_and_printing_into_a_dead_pipe_goes_on(tmp_path):
    """A child configures grpod's logging, then (its stderr's reader gone) logs and prints: it
    finishes, and its grpod.log has the events the console lost."""
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        import structlog
        from grpod.service.logs import configure_logging
        configure_logging(Path({str(tmp_path / "run")!r}), "info")
        sys.stdin.read()  # the parent closes its end of our stderr, then our stdin
        log = structlog.get_logger("t")
        for i in range(2000):
            log.warning("after_the_reader_left", i=i)
            print("a console line", i, file=sys.stderr, flush=True)
        Path({str(tmp_path / "done")!r}).write_text("done")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    proc.stderr.close()
    proc.stdin.close()
    proc.wait(timeout=60)
    assert (tmp_path / "done").read_text() == "done"
    events = [json.loads(line) for line in (tmp_path / "run" / "grpod.log").read_text().splitlines()]
    assert [e["i"] for e in events if e["event"] == "after_the_reader_left"] == list(range(2000))


def test_a_metric_that_is_not_finite_is_written_as_null(tmp_path):
    """A reward's `log_metric("x", nan)` wrote a bare NaN into metrics.jsonl: no strict JSON reader
    could read any line of the run after it."""
    import json
    import math

    import numpy as np
    import pytest

    from grpod.service.logs import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write("step", 1, {"reward_log/x": math.nan, "loss": np.float32("inf"), "ok": 0.5, "nested": {"v": [math.nan, 1.0]}})
    line = (tmp_path / "metrics.jsonl").read_text()
    record = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {line}"))
    assert record["reward_log/x"] is None and record["loss"] is None and record["ok"] == 0.5
    assert record["nested"] == {"v": [None, 1.0]}


def test_an_event_with_a_value_that_is_not_finite_is_logged_as_json(tmp_path):
    """The trainer's `update_skipped` carries a NaN grad_norm: grpod.log wrote a bare NaN, no JSON,
    on exactly the lines an operator's log shipper must read."""
    import io
    import logging
    import math

    from grpod.service.logs import _Tee

    path = tmp_path / "grpod.log"
    tee = _Tee(LineFile(path), io.StringIO(), logging.ERROR)
    tee(None, "warning", {"event": "update_skipped", "level": "warning", "grad_norm": math.nan, "loss": -math.inf})
    line = path.read_text()
    record = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {line}"))
    assert record["grad_norm"] is None and record["loss"] is None and record["event"] == "update_skipped"


def test_a_log_a_child_process_appends_to_is_cut_to_its_end_and_the_child_writes_on(tmp_path):
    """A child given the log as its stderr (as the reward workers, the engines and the
    environments are) prints 4 MiB while LogLimit checks the directory: the file stays under the
    limit plus what one check period lets through, starts with the line saying it was cut, keeps
    whole lines from the end, and the child's last line is there at its end (no hole of zeros
    where the file was before the cut). metrics.jsonl in the same directory is never cut."""
    from grpod.service.logs import CUT_MARK, LogLimit

    limit = 256 << 10
    (tmp_path / "metrics.jsonl").write_bytes(b"{}\n" * 200_000)  # 600 KB of records
    log_path = tmp_path / "rewards.log"
    script = textwrap.dedent("""
        import sys, time
        for i in range(4096):
            sys.stderr.write(f"line {i:05d} " + "x" * 1012 + "\\n")
            sys.stderr.flush()
            if i % 256 == 255:
                time.sleep(0.05)
        sys.stderr.write("last line\\n")
    """)
    limits = LogLimit(tmp_path, limit)
    with open(log_path, "ab") as stderr:
        child = subprocess.Popen([sys.executable, "-c", script], stderr=stderr)
    try:
        while child.poll() is None:
            limits.check()
    finally:
        child.kill()
        child.wait()
    limits.check()
    data = log_path.read_bytes()
    assert limits.cuts >= 2, limits.cuts
    assert data.startswith(b"=== grpod: cut ") and CUT_MARK.split("{")[0].encode() in data
    assert b"\0" not in data
    assert data.endswith(b"last line\n")
    lines = data.decode().splitlines()[1:-1]
    assert lines and all(line.startswith("line ") and len(line) == 1023 for line in lines)
    assert len(data) <= limit
    assert (tmp_path / "metrics.jsonl").stat().st_size == 600_000


def test_no_limit_cuts_nothing_and_a_file_under_it_is_left_alone(tmp_path):
    from grpod.service.logs import LogLimit, cut_log

    path = tmp_path / "vllm.log"
    path.write_bytes(b"a line\n" * 1000)
    LogLimit(tmp_path, None).check()
    assert cut_log(path, 7000) == 0 and path.stat().st_size == 7000
    assert cut_log(path, 6999) > 0 and path.stat().st_size < 6999


def test_lines_appended_while_a_log_is_cut_are_kept(tmp_path):
    """A writer (vLLM's stdout, say) appends while the file is cut: its lines, and the half line
    it was writing when the tail was read, follow the kept lines; they were lost before."""
    import io

    from grpod.service.logs import cut_log

    path = tmp_path / "vllm.log"
    path.write_bytes(b"".join(b"line %05d\n" % i for i in range(1000)) + b"line 01")  # a line being written
    writer = os.open(path, os.O_WRONLY | os.O_APPEND)

    class AppendedMeanwhile(io.FileIO):
        reads = 0

        def read(self, *args):
            data = super().read(*args)
            AppendedMeanwhile.reads += 1
            if AppendedMeanwhile.reads <= 2:  # after the tail is read, and after the first catch-up
                os.write(writer, b"000\n" if AppendedMeanwhile.reads == 1 else b"line 01001\n")
            return data

    class LogPath(type(path)):
        def open(self, mode="r", *args, **kwargs):
            return AppendedMeanwhile(str(self), "r+")

    try:
        assert cut_log(LogPath(path), 4000) > 0
    finally:
        os.close(writer)
    lines = path.read_text().splitlines()
    assert lines[0].startswith("=== grpod: cut") and lines[-2:] == ["line 01000", "line 01001"], lines[-3:]
    numbers = [int(line.split()[1]) for line in lines[1:]]
    assert numbers == list(range(numbers[0], 1002)), "no line lost, none twice"


# ---- a full disk under the run directory (a real one: a small tmpfs) ------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs and a filler that fills it; the filler is removed to free the space."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                                           capture_output=True, timeout=30).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def _fill(mount: Path) -> Path:
    filler = mount / "filler"
    with open(filler, "ab", buffering=0) as fh:
        with pytest.raises(OSError) as full:
            while True:
                fh.write(b"\0" * 4096)
    assert full.value.errno == errno.ENOSPC
    return filler


def test_a_line_that_does_not_fit_leaves_the_file_as_it_was(small_disk):
    lines = LineFile(small_disk / "metrics.jsonl")
    lines.append('{"a": 1}\n')
    filler = _fill(small_disk)
    big = json.dumps({"b": "x" * 200_000}) + "\n"  # more than the bytes the filler left over
    with pytest.raises(OSError):
        lines.append(big)
    assert (small_disk / "metrics.jsonl").read_text() == '{"a": 1}\n', "no part of the failed line stays"
    filler.unlink()
    lines.append(big)
    assert read_metrics(small_disk / "metrics.jsonl") == [{"a": 1}, {"b": "x" * 200_000}]


def test_metrics_wait_in_memory_while_the_disk_is_full_and_are_written_in_order(small_disk):
    metrics = MetricsLog(small_disk / "metrics.jsonl")
    metrics.write("step", 1, {"loss": 1.0})
    filler = _fill(small_disk)
    for step in range(2, 40):  # a run that goes on: no write raises
        metrics.write("step", step, {"loss": 1.0, "pad": "x" * 5000})  # more than a page: needs space
    assert [r["step"] for r in read_metrics(small_disk)] == [1]
    filler.unlink()
    metrics.write("step", 40, {"loss": 1.0})
    assert [r["step"] for r in read_metrics(small_disk)] == list(range(1, 41))


def test_the_event_log_outlives_a_full_disk_and_says_what_it_lost(small_disk):
    script = textwrap.dedent(f"""
        import errno, structlog
        from pathlib import Path
        from grpod.service.logs import configure_logging
        run = Path({str(small_disk)!r})
        configure_logging(run, "error")
        log = structlog.get_logger("t")
        log.info("before")
        with open(run / "filler", "ab", buffering=0) as fh:
            try:
                while True:
                    fh.write(b"0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        for i in range(50):
            log.info("while_full", i=i, pad="x" * 2000)
        (run / "filler").unlink()
        log.info("after")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "cannot write" in done.stderr and "No space left" in done.stderr
    events = [json.loads(line) for line in (small_disk / "grpod.log").read_text().splitlines()]
    names = [e["event"] for e in events]
    assert names[0] == "before" and names[-2:] == ["log_lines_lost", "after"], names
    assert names.count("while_full") + events[-2]["lines"] == 50 and events[-2]["lines"] > 0


def test_a_last_line_cut_off_by_a_kill_is_removed_before_the_next_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "step", "step": 1}\n{"kind": "step", "st')
    MetricsLog(path).write("step", 2, {"loss": 0.5})
    assert [r["step"] for r in read_metrics(path)] == [1, 2], "no half line in the middle of the file"


def test_a_repeat_throttle_admits_the_first_then_one_per_interval_with_the_count_held_back():
    throttle = RepeatThrottle(every_s=30.0)
    assert throttle.admit("a", now=0.0) == 0
    assert throttle.admit("b", now=1.0) == 0  # each key on its own
    assert [throttle.admit("a", now=t) for t in (1.0, 2.0, 29.0)] == [None, None, None]
    assert throttle.drain() == {"a": 3}
    assert throttle.drain() == {}  # said once
    throttle.admit("a", now=29.5)
    assert throttle.admit("a", now=30.0) == 1
