"""``tierfs csi``: the node daemon of a Kubernetes node, serving CSI on a unix socket.

It keeps the node's tierfs mount up at ``--mount-dir`` (through ``tierfs
mount``, with the same mount options), and serves the CSI Identity and Node
services (:mod:`tierfs.csi.server`) at ``--endpoint`` until SIGTERM/SIGINT.
On the way out the node mount is unmounted only if no volume is published;
otherwise it is left to the pods using it and adopted by the next driver.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

import click

from tierfs.cli import options
from tierfs.core import settings, sizes

DEFAULT_MOUNT_DIR = "/run/tierfs/mount"
DEFAULT_STATE_DIR = "/run/tierfs/csi"
#: in the state dir: how the node mount was started (see SupervisedMount.check_adopted)
NODE_MOUNT_RECORD = "node-mount.json"

log = logging.getLogger("tierfs.csi")


def _mount_params() -> list[click.Parameter]:
    """The click parameters ``mount_options`` adds (shared with ``tierfs mount``)."""
    return options.schema_params()


def mount_argv(opts: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """Turn the parsed mount options back into ``tierfs mount`` arguments.

    ``allow_other`` is always added: pods run as any user. A peer token goes
    into the environment (``TIERFS_PEER_TOKEN``), never onto a command line.

    Returns:
        ``(argv, env)``: the arguments after ``tierfs mount MOUNTPOINT`` and extra environment.
    """
    argv: list[str] = []
    env: dict[str, str] = {}
    for param in _mount_params():
        value = opts.get(param.name or "")
        if value is None or value == () or value is False:
            continue
        if param.name == "peer_token":
            env[settings.PEER_TOKEN.name] = str(value)
            continue
        flag = param.opts[0]
        for v in value if isinstance(value, (list, tuple)) else [value]:
            argv += [flag, str(v)]
    if not any("allow_other" in o.split(",") for o in opts.get("option") or ()):
        argv += ["-o", "allow_other"]
    return argv, env


def configured_ram_dir(opts: dict[str, Any]) -> str | None:
    """The ram-dir ``tierfs mount`` will be given: ``--ram-dir``, else ``ramDir`` of ``--config``.

    None if neither names one or the config file cannot be read (``tierfs
    mount`` then reports the error, and Probe with it).
    """
    if opts.get("ram_dir"):
        return str(opts["ram_dir"])
    if opts.get("config"):
        from tierfs.core.config import ConfigError, load_config_file

        try:
            value = load_config_file(opts["config"]).get("ram_dir")
        except ConfigError:
            return None
        return str(value) if value else None
    return None


def configured_size(opts: dict[str, Any]) -> int | None:
    """The RAM budget ``tierfs mount`` will be given (bytes): ``--size``, else the
    ``inMemoryVolumeSize``/``size`` of ``--config``; None if neither (or unreadable)."""
    from tierfs.core.config import ConfigError, load_config_file, parse_size

    try:
        if opts.get("size"):
            return parse_size(opts["size"])
        if opts.get("config"):
            value = load_config_file(opts["config"]).get("size")
            return parse_size(value) if value else None
    except ConfigError:
        return None  # `tierfs mount` reports it
    return None


def fit_ram_volume(opts: dict[str, Any]) -> None:
    """Size the RAM volume's tmpfs to the budget (``--resize-ram-volume``; see
    :func:`tierfs.store.ramtmpfs.fit_volume`), so the kernel enforces ``--size`` and file
    data keeps passthrough. Logs what it did; never fails the driver."""
    from tierfs.store import ramtmpfs

    ram_dir, size = configured_ram_dir(opts), configured_size(opts)
    if not ram_dir or not size:
        return
    try:
        message = ramtmpfs.fit_volume(os.path.realpath(ram_dir), size)
    except OSError as exc:
        message = f"cannot size the RAM volume {ram_dir}: {exc}"
    if message.startswith("resized"):
        log.info("%s", message)
    elif message:
        log.warning("%s", message)


def _make_command(mount_options: Any) -> click.Command:
    """Build the ``csi`` click command around the shared ``mount_options``."""

    @click.command("csi", cls=options.SchemaCommand)
    @click.option(
        "--endpoint",
        envvar="CSI_ENDPOINT",
        default="unix:///csi/csi.sock",
        show_default=True,
        help="CSI endpoint, unix:///path.sock (or $CSI_ENDPOINT).",
    )
    @click.option(
        "--node-id",
        envvar="NODE_ID",
        required=True,
        help="This node's id, normally the Kubernetes node name (or $NODE_ID).",
    )
    @click.option(
        "--driver-name",
        default="tierfs.csi.dev",
        show_default=True,
        help="CSI driver name (the CSIDriver object's name; at most 63 characters).",
    )
    @click.option(
        "--mount-dir",
        default=DEFAULT_MOUNT_DIR,
        show_default=True,
        help="Where the node's tierfs mount lives; volumes are bind mounts of it.",
    )
    @click.option(
        "--state-dir",
        default=DEFAULT_STATE_DIR,
        show_default=True,
        help="Small per-target publish records (no secrets).",
    )
    @click.option(
        "--resize-ram-volume",
        is_flag=True,
        help="--ram-dir is a memory-backed volume of this driver alone (the "
        "DaemonSet's emptyDir): size its tmpfs to --size when it is larger, "
        "so the kernel enforces the budget and file data keeps FUSE "
        "passthrough. Never for a shared tmpfs such as /dev/shm.",
    )
    @mount_options
    def csi(**opts: Any) -> None:
        """Run the CSI node driver: keep the node's tierfs mount up and serve CSI on a socket."""
        from tierfs.csi import server
        from tierfs.csi.nodemount import SupervisedMount, become_subreaper

        level = (opts.get("log_level") or "INFO").upper()
        logging.basicConfig(
            level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        if not opts.get("ram_dir") and not opts.get("config"):
            raise click.ClickException("--ram-dir is required (or ramDir in --config)")
        try:
            server.validate_driver_name(opts["driver_name"])
            server.socket_path(opts["endpoint"])
            settings.check_environment()  # the node mount's environment, too
            if opts.get("size"):
                sizes.parse_size(opts["size"], "--size")
        except ValueError as exc:  # SettingError and SizeError included
            raise click.ClickException(str(exc)) from None
        argv, env = mount_argv(opts)
        node = SupervisedMount(
            opts["mount_dir"],
            argv,
            env=env,
            ram_dir=configured_ram_dir(opts),
            record_path=os.path.join(opts["state_dir"], NODE_MOUNT_RECORD),
        )
        identity = server.IdentityService(opts["driver_name"], node)
        service = server.NodeService(opts["node_id"], node, opts["state_dir"])

        stop = threading.Event()

        def on_signal(signum: int, frame: Any) -> None:
            log.info("signal %d: stopping", signum)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        try:
            grpc_server = server.serve(opts["endpoint"], identity, service)
        except (OSError, RuntimeError, ValueError) as exc:
            raise click.ClickException(f"cannot serve CSI on {opts['endpoint']}: {exc}") from None
        if opts.get("resize_ram_volume"):
            fit_ram_volume(opts)
        become_subreaper()  # the daemon `tierfs mount` starts becomes our child
        node.start()
        log.info(
            "tierfs %s CSI node driver %s on node %s (mount %s, pid %d)",
            _version(),
            opts["driver_name"],
            opts["node_id"],
            node.mountpoint,
            os.getpid(),
        )
        try:
            while not stop.wait(1.0):
                pass
        finally:
            grpc_server.stop(5).wait(10)
            server.remove_socket(opts["endpoint"])
            node.stop()
            node.unmount_if_unused()
            log.info("CSI driver stopped")

    return csi


_command: click.Command | None = None


def __getattr__(name: str) -> Any:
    """Build ``csi`` on first access (PEP 562).

    ``tierfs.cli.main`` imports this module from ``_register_plugins`` while it is
    itself being imported, so this module must not import ``tierfs.cli.main`` at
    its top: the command is made when first asked for, and the re-entrant
    import (``tierfs.cli.main`` registering plugins again) finds it made.
    """
    global _command
    if name != "csi":
        raise AttributeError(name)
    if _command is None:
        from tierfs.cli.main import mount_options  # may re-enter this function

        if _command is None:
            _command = _make_command(mount_options)
    return _command


def _version() -> str:
    from tierfs import __version__

    return __version__
