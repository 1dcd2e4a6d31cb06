"""Fixtures of the fault-injection suite.

Every case records one or more rows (`fault_case("...")`): what was broken, how long the daemon
took to recover, what data was lost (must be none). A row's outcome is its test's outcome (setup,
call and teardown together), filled in by `pytest_runtest_makereport`, so a row can never say
"passed" for a test that failed. The table itself, printed at the end of the run and written as
JSON, is tests/faults/table.py.

One decoy process (command line with "vllm" and "grpod") lives for the whole session (each xdist
worker's); after every case it must still be alive (case 7), and it is killed by its PID at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.table import TABLE, FaultRow
from tests.harness import start_decoy


@pytest.fixture
def fault_case(request):
    """`fault_case(name)` → a FaultRow of this test; set recovery_s, data_lost and notes on it."""

    def add(case: str) -> FaultRow:
        return TABLE.add(case, request.node.nodeid)

    return add


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)
        TABLE.failed_nodes.setdefault(item.nodeid, f"{report.when}: {message.splitlines()[0][:200]}")
    if report.skipped:
        TABLE.skipped_nodes.add(item.nodeid)
    if report.when != "teardown":
        return
    for row in TABLE.rows:
        if row.nodeid != item.nodeid:
            continue
        if item.nodeid in TABLE.failed_nodes:
            row.outcome = "failed"
            row.notes = (row.notes + "; " if row.notes else "") + TABLE.failed_nodes[item.nodeid]
        elif item.nodeid in TABLE.skipped_nodes:
            row.outcome = "skipped"
        else:
            row.outcome = "passed"


@pytest.fixture(scope="session")
def decoy(tmp_path_factory):
    """A process whose command line says "vllm" and "grpod"; grpod must never signal it."""
    TABLE.out_dir = tmp_path_factory.getbasetemp()
    proc = start_decoy(tmp_path_factory.mktemp("decoy"))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(autouse=True)
def decoy_untouched(decoy, request):
    """After every case: the decoy is still alive (case 7)."""
    yield
    TABLE.decoy_checks += 1
    if decoy.poll() is not None:
        TABLE.decoy_failures.append(request.node.name)
        pytest.fail(f"the decoy process {decoy.pid} (cmdline with vllm + grpod) died during {request.node.name}: "
                    f"exit {decoy.returncode}; grpod signalled a process it did not start")


@pytest.fixture(scope="session")
def fault_model_dir(tmp_path_factory) -> Path:
    """The tiny built-in model with random weights (seed 0), saved in HF format.

    Recovery does not depend on what the model has learned, and skipping the supervised warm-up
    keeps this suite's set-up to a couple of seconds.
    """
    from grpod.models.tiny import build_model, save_model

    out = tmp_path_factory.mktemp("fault-model") / "tiny"
    model, tokenizer = build_model(seed=0)
    save_model(model, tokenizer, out)
    return out
