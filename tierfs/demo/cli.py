"""The ``tierfs demo`` command."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command()
@click.option("--nodes", default=4, show_default=True, help="Local node daemons and ranks.")
@click.option(
    "--steps",
    default=50,
    show_default=True,
    help="Training length in steps; extended where needed so that two backup "
    "periods follow the node failure (the default run ends at step 55).",
)
@click.option("--save-every", default=5, show_default=True, help="Checkpoint period (steps).")
@click.option("--backup-every", default=10, show_default=True, help="GCS backup period (steps).")
@click.option(
    "--model-size",
    default="small",
    show_default=True,
    type=click.Choice(["tiny", "small", "medium", "large"]),
    help="Width of the MLP (small ≈ 1 MB of checkpoint per rank, large ≈ 50 MB).",
)
@click.option(
    "--out",
    default="demo-out",
    show_default=True,
    type=click.Path(),
    help="Directory for the log, timeline, trainer events and plot.",
)
@click.option(
    "--step-delay", default=0.1, show_default=True, help="Seconds each training step sleeps."
)
@click.option(
    "--timeout", default=120.0, show_default=True, help="Seconds any single wait may take."
)
@click.option("--keep", is_flag=True, help="Keep the RAM stores under /dev/shm afterwards.")
def demo(
    nodes: int,
    steps: int,
    save_every: int,
    backup_every: int,
    model_size: str,
    out: str,
    step_delay: float,
    timeout: float,
    keep: bool,
) -> None:
    """Run a real PyTorch job on local tierfs nodes through a node loss and a cluster loss."""
    from tierfs.demo.orchestrator import (
        Demo,
        DemoConfig,
        DemoError,
        DemoInterrupted,
        interrupt_on_signals,
    )

    if nodes < 2:
        raise click.ClickException("--nodes must be at least 2 (a peer must hold a copy)")
    if backup_every % save_every:
        raise click.ClickException("--backup-every must be a multiple of --save-every")
    config = DemoConfig(
        nodes=nodes,
        steps=steps,
        save_every=save_every,
        backup_every=backup_every,
        model_size=model_size,
        out=Path(out),
        step_delay=step_delay,
        timeout=timeout,
        keep=keep,
    )
    interrupt_on_signals()  # SIGTERM/SIGHUP stop what the demo started, as Ctrl-C does
    try:
        summary = Demo(config).run()
    except DemoInterrupted as exc:
        click.echo(
            f"demo stopped: {exc}; everything it started was stopped (logs in {out}/logs)", err=True
        )
        sys.exit(128 + exc.signum)
    except DemoError as exc:
        raise click.ClickException(f"demo failed: {exc} (logs in {out}/logs)") from None
    if not summary["ok"]:
        click.echo("FINAL CHECK FAILED:", err=True)
        for p in summary["problems"]:
            click.echo(f"  {p}", err=True)
        sys.exit(1)
    click.echo(
        f"FINAL CHECK PASSED: every restored state equals the saved state (details in {out}/)"
    )
