"""The ``tierfs`` command line: the command group, ``mount`` and ``status``.

``tierfs mount`` behaves like gcsfuse: it checks its arguments
(:mod:`tierfs.cli.checks`), starts the node daemon in the background and
returns once the mount answers, or stays in the foreground with
``--foreground`` (:mod:`tierfs.cli.spawn`). Errors are one line on stderr and
exit status 1. The other commands live in modules of their own:
``unmount`` (:mod:`tierfs.cli.unmount`), ``wait`` (:mod:`tierfs.cli.wait`),
``backups`` (:mod:`tierfs.cli.backups`), ``csi`` (:mod:`tierfs.csi.cli`) and
``demo`` (:mod:`tierfs.demo.cli`); the status is read by
:mod:`tierfs.cli.status_file` and drawn by :mod:`tierfs.cli.status`.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import click

from tierfs import __version__
from tierfs.cli.checks import (
    check_bucket,
    check_log_file,
    check_mountpoint,
    check_overlap,
    check_ram_dir,
    check_size,
    discard_empty_file,
    pid_running,
)
from tierfs.cli.console import fail
from tierfs.cli.nodes import nodes
from tierfs.cli.options import SchemaCommand, mount_options
from tierfs.cli.spawn import read_config_stdin, run_daemon, spawn_daemon
from tierfs.cli.status_file import STATUS_TIMEOUT, DaemonNotAnswering, not_answering, read_status
from tierfs.cli.unmount import unmount
from tierfs.cli.wait import WAIT_EXIT, wait_cmd, wait_outcome
from tierfs.core import config as node_settings
from tierfs.core import settings
from tierfs.core.config import ConfigError, format_size

if TYPE_CHECKING:
    from tierfs.core.node_config import NodeConfig


def _build_config(opts: dict[str, Any], notes: list[str] | None = None) -> NodeConfig:
    """The NodeConfig of ``tierfs mount``'s options (flags over ``--config`` over
    ``TIERFS_PEER_TOKEN``; :func:`tierfs.core.config.build_config`); a size with a bare
    decimal suffix adds a line to ``notes`` (:func:`tierfs.core.sizes.decimal_note`).

    Raises:
        ConfigError: naming the first bad setting.
    """
    config = node_settings.build_config(opts, opts.get("config"), notes=notes)
    # symlinks resolved: /proc/self/mountinfo, `tierfs unmount` and status all
    # name the real path
    config.mountpoint = os.path.realpath(opts["mountpoint"])
    if not config.ram_dir:
        fail("--ram-dir is required (or ramDir in --config)")
    config.ram_dir = os.path.realpath(config.ram_dir)
    if config.log_file:
        config.log_file = os.path.abspath(config.log_file)
    return config


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tierfs")
def main() -> None:
    """tierfs: a tiered checkpoint store (RAM, peers, Google Cloud Storage) behind a FUSE mount."""


@main.command(cls=SchemaCommand)
@click.argument("mountpoint", type=click.Path())
@mount_options
@click.option("-f", "--foreground", is_flag=True, help="Stay in the foreground.")
@click.option("--ready-fd", type=int, hidden=True)
def mount(**opts: Any) -> None:
    """Mount tierfs at MOUNTPOINT, keeping every byte in RAM under --ram-dir."""
    notes: list[str] = []
    try:
        config = _build_config(opts, notes)
        settings.check_environment()
    except ConfigError as exc:
        fail(str(exc))
    if opts.get("ready_fd") is None:
        for note in notes:
            click.echo(f"tierfs: note: {note}", err=True)
    from tierfs.fuse.session import MountOptionError, MountOptions

    try:
        MountOptions.parse(config.mount_options)
    except MountOptionError as exc:
        fail(_mount_option_error(opts.get("config"), exc))
    ready_fd = opts.get("ready_fd")
    if ready_fd is not None:
        run_daemon(config, False, ready_fd)
        return
    created_log = check_log_file(config.log_file)
    try:
        check_overlap(config.mountpoint, config.ram_dir)
        nonempty = any("nonempty" in o.split(",") for o in config.mount_options)
        check_mountpoint(config.mountpoint, nonempty)
        check_bucket(config.bucket)
        check_ram_dir(config.ram_dir, config.size)
        check_size(config.ram_dir, config.size)
        if opts["foreground"]:
            run_daemon(config, True, None)
        else:
            spawn_daemon(config)
    except click.ClickException:
        if created_log and config.log_file:
            discard_empty_file(config.log_file)
        raise


def _mount_option_error(config_file: str | None, exc: Exception) -> str:
    """The line for mount options that do not parse: a bad option of the ``--config``
    file is named with its key and the file (``mountOptions in PATH: ...``), one of
    ``-o`` as before."""
    from tierfs.fuse.session import MountOptionError, MountOptions

    if config_file:
        try:
            data, origins = node_settings.read_config_file(config_file)
            MountOptions.parse(list(data.get("mount_options") or []))
        except MountOptionError as file_exc:
            return f"{origins['mount_options']}: {file_exc}"
        except ConfigError:
            pass
    return str(exc)


@main.command("_daemon", hidden=True)
@click.option("--ready-fd", type=int, required=True)
def _daemon(ready_fd: int) -> None:
    """Run the daemon (started by ``tierfs mount``; the configuration comes on stdin)."""
    run_daemon(read_config_stdin(), False, ready_fd)


@main.command()
@click.argument("mountpoint", type=str)  # not click.Path: its stat waits on a stuck daemon
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
def status(mountpoint: str, as_json: bool) -> None:
    """Show the job, its steps, the RAM budget and recent errors of a mount."""
    try:
        data = read_status(mountpoint, STATUS_TIMEOUT)
    except DaemonNotAnswering:
        fail(not_answering(mountpoint, STATUS_TIMEOUT))
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    from tierfs.cli.status import render_status

    render_status(data)


def _register_plugins() -> None:
    """Attach the commands that live with their tier, where that module exists."""
    import importlib
    import importlib.util

    for module, name in (
        ("tierfs.cli.backups", "backups"),
        ("tierfs.csi.cli", "csi"),
        ("tierfs.demo.cli", "demo"),
    ):
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except ModuleNotFoundError:  # the parent package does not exist yet
            continue
        main.add_command(getattr(importlib.import_module(module), name))


main.add_command(unmount)
main.add_command(wait_cmd)
main.add_command(nodes)
_register_plugins()

# read_status, pid_running, WAIT_EXIT and wait_outcome: imported from here by older code
__all__ = [
    "WAIT_EXIT",
    "format_size",
    "main",
    "mount_options",
    "pid_running",
    "read_status",
    "wait_outcome",
]
