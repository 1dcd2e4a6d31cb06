"""The systemd units as systemd reads them: what they restart, and how their stops are timed.

systemd is not run here (no init in the test machine); the units' settings are read as systemd
parses them (one `Key=value` per line, `#` comments, sections) and checked against what grpod
does: exit 2 means the operator's input, and `ctl stop` waits for the daemon within its --timeout.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def unit(name: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in (ROOT / "systemd" / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def seconds(span: str) -> float:
    units = {"min": 60, "s": 1, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(min|s|h)", span))


@pytest.mark.parametrize("name", ["grpod.service", "grpod-agent.service"])
def test_an_input_error_is_not_restarted(name):
    """Restart=on-failure restarted exit 2 (a config error, a refused resume, a held run
    directory) every RestartSec for ever: systemd's start limit never trips at that pace."""
    settings = unit(name)
    assert settings["Restart"] == ["on-failure"]
    prevented = " ".join(settings.get("RestartPreventExitStatus", [])).split()
    assert "2" in prevented, settings


def test_ctl_stop_gives_up_before_systemd_kills_the_service():
    """`grpod ctl stop` waits up to --timeout (default 600 s) for the daemon's exit; with
    TimeoutStopSec=10min both expired together."""
    settings = unit("grpod.service")
    [stop] = settings["ExecStop"]
    argv = shlex.split(stop)
    assert argv[1:3] == ["ctl", "stop"] and "--timeout" in argv, argv
    timeout = float(argv[argv.index("--timeout") + 1])
    assert timeout < seconds(settings["TimeoutStopSec"][0]), (timeout, settings["TimeoutStopSec"])
