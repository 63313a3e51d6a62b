"""How every ``tierfs`` command reports: one line on stderr, exit status 1 on an error."""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import click

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["fail", "stdout_console", "warn"]


def fail(msg: str) -> NoReturn:
    """End the command: ``Error: <msg>`` on stderr, exit status 1.

    Raises:
        click.ClickException: always.
    """
    raise click.ClickException(msg)


def warn(msg: str) -> None:
    """``tierfs: warning: <msg>`` on stderr; the command goes on."""
    click.echo(f"tierfs: warning: {msg}", err=True)


def stdout_console(markup: bool = True) -> Console:
    """A rich console for stdout; when stdout is not a terminal (a pipe, a file) lines
    are never wrapped or cut (rich would wrap at 80 columns: `tierfs backups list |
    less` showed one word per line)."""
    from rich.console import Console

    probe = Console(markup=markup)
    if probe.is_terminal:
        return probe
    return Console(width=10_000, soft_wrap=True, markup=markup)
