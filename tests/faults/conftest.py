"""Fixtures of the fault-injection suite, and the table it prints at the end.

Every case records one or more rows (`fault_case("...")`): what was broken, how long the daemon
took to recover, what data was lost (must be none). A row's outcome is its test's outcome (setup,
call and teardown together), filled in by `pytest_runtest_makereport`, so a row can never say
"passed" for a test that failed. The table is printed by `pytest_terminal_summary` and written
as JSON to `<pytest basetemp>/faults.json`, and to the file named by GRPOD_FAULTS_RESULTS when
set (`make test-faults` sets `bench/results/faults.json`; tests never write tracked files by
themselves).

One decoy process (command line with "vllm" and "grpod") lives for the whole session; after every
case it must still be alive (case 7), and it is killed by its PID at the end.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from tests.harness import start_decoy

RESULTS_JSON = os.environ.get("GRPOD_FAULTS_RESULTS")


@dataclass
class FaultRow:
    case: str
    nodeid: str
    outcome: str = "not finished"
    recovery_s: float | None = None
    data_lost: str = "not measured"
    notes: str = ""


@dataclass
class FaultTable:
    rows: list[FaultRow] = field(default_factory=list)
    failed_nodes: dict[str, str] = field(default_factory=dict)
    skipped_nodes: set[str] = field(default_factory=set)
    decoy_checks: int = 0
    decoy_failures: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    out_dir: Path | None = None

    def add(self, case: str, nodeid: str) -> FaultRow:
        row = FaultRow(case, nodeid)
        self.rows.append(row)
        return row

    def all_rows(self) -> list[FaultRow]:
        """Rows in case order ("3b" after "3a", before "4"), the decoy's row among them."""
        rows = list(self.rows)
        if self.decoy_checks:
            rows.append(
                FaultRow(
                    "7 decoy (cmdline has vllm + grpod) survives every case",
                    "tests/faults (every case)",
                    outcome="failed" if self.decoy_failures else "passed",
                    data_lost="none",
                    notes=f"alive after {self.decoy_checks - len(self.decoy_failures)}/{self.decoy_checks} cases"
                    + (f"; dead after {', '.join(self.decoy_failures)}" if self.decoy_failures else ""),
                )
            )
        return sorted(rows, key=_case_order)


def _case_order(row: FaultRow) -> tuple[int, str]:
    label = row.case.split()[0]
    digits = label[: len(label) - len(label.lstrip("0123456789"))]
    return (int(digits) if digits else 99, label)


TABLE = FaultTable()


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


def _fmt_seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = TABLE.all_rows()
    if not TABLE.rows:
        return
    headers = ("case", "outcome", "recovery", "data lost", "notes")
    cells = [(r.case, r.outcome, _fmt_seconds(r.recovery_s), r.data_lost, r.notes) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if i < 4 else 0 for i, h in enumerate(headers)]
    tr = terminalreporter
    tr.section("fault injection")
    tr.write_line("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    for c in cells:
        tr.write_line("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())
    wall_s = time.monotonic() - TABLE.started
    tr.write_line(f"fault suite wall time: {wall_s:.0f} s")
    payload = {"wall_s": round(wall_s, 1), "cases": [asdict(r) for r in rows]}
    targets = ([Path(RESULTS_JSON)] if RESULTS_JSON else []) + ([TABLE.out_dir / "faults.json"] if TABLE.out_dir else [])
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(payload, indent=1) + "\n")
    tr.write_line("written: " + ", ".join(str(t) for t in targets))


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
