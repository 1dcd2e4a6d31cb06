"""The `grpod` command line: what it accepts."""

from grpod.daemon.desk import OperatorDesk


def test_the_ctl_subcommand_accepts_exactly_the_desks_commands():
    from grpod.cli import _parser

    ctl = next(a for a in _parser()._subparsers._group_actions[0].choices["ctl"]._actions if a.dest == "cmd")
    assert tuple(ctl.choices) == OperatorDesk.commands()
