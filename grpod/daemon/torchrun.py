"""Whether torchrun launched this process: what the CLI and the components ask before choosing a
single-process trainer or the trainer ranks (`grpod.daemon.ranks`). Its own module so that asking
does not import the ranks' runner (which runs the supervisor, which builds the components)."""

from __future__ import annotations

import os

# The variables torchrun sets for every rank it starts.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """Whether torchrun (or a launcher setting the same variables) started this process."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)
