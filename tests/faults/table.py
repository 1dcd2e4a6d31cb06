"""The fault-injection suite's table: one row per case, printed at the end of the test run and
written as JSON to `<pytest basetemp>/faults.json`, and to the file named by GRPOD_FAULTS_RESULTS
when set (`make test-faults` sets `bench/results/faults.json`; tests never write tracked files by
themselves). tests/faults/conftest.py fills it in.

A plugin of the whole run (tests/conftest.py names it), not a conftest of tests/faults: under
xdist (`make test` runs two workers) the cases run in the workers, each sends its rows back as it
ends, and the process that prints the run's summary prints the table once.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

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

    def dump(self) -> dict:
        """What an xdist worker sends back: its rows and its decoy's checks."""
        return {"rows": [asdict(r) for r in self.rows], "decoy_checks": self.decoy_checks,
                "decoy_failures": list(self.decoy_failures),
                "out_dir": str(self.out_dir) if self.out_dir else None}

    def merge(self, dumped: dict) -> None:
        """A worker's rows into this table (the controller's)."""
        self.rows.extend(FaultRow(**row) for row in dumped["rows"])
        self.decoy_checks += dumped["decoy_checks"]
        self.decoy_failures.extend(dumped["decoy_failures"])
        if dumped["out_dir"]:  # a worker's basetemp lies in the run's own
            self.out_dir = Path(dumped["out_dir"]).parent


def _case_order(row: FaultRow) -> tuple[int, str]:
    label = row.case.split()[0]
    digits = label[: len(label) - len(label.lstrip("0123456789"))]
    return (int(digits) if digits else 99, label)


TABLE = FaultTable()


def _fmt_seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its rows go to the controller
        session.config.workeroutput["fault_table"] = TABLE.dump()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """An xdist worker ended (the controller): its rows join the table."""
    dumped = getattr(node, "workeroutput", {}).get("fault_table")
    if dumped:
        TABLE.merge(dumped)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workeroutput"):
        return
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
