"""The console of a daemon whose reader went away: a dead pipe costs console lines, never the
caller (logging or printing), and the event log still gets every event."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from grpod.service.logs import _Console


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
