"""How every ``tierfs`` command reports: one line on stderr, exit status 1 on an error."""

from __future__ import annotations

from typing import NoReturn

import click

__all__ = ["fail", "warn"]


def fail(msg: str) -> NoReturn:
    """End the command: ``Error: <msg>`` on stderr, exit status 1.

    Raises:
        click.ClickException: always.
    """
    raise click.ClickException(msg)


def warn(msg: str) -> None:
    """``tierfs: warning: <msg>`` on stderr; the command goes on."""
    click.echo(f"tierfs: warning: {msg}", err=True)
