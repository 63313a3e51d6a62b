"""``tierfs nodes gone``: declare node ranks gone for good without restarting the job
(issue #16).

The command reads the mount's status for the job name and the coordinator's
address (node-rank 0's peer port), then calls the coordinator's ``Gone`` rpc
straight over the peer plane with the job's peer token (``--peer-token`` or
``$TIERFS_PEER_TOKEN``, as ``tierfs mount`` takes it). The coordinator keeps
the gone set with the generation (node-rank 0's ``coordinator-generation.json``)
and sends it to every node in its Join and Sync replies.

Exit codes: 0 declared (the gone ranks are printed; a warning on stderr names
those that were still heartbeating, which the coordinator declares anyway); 1 the
mount has no job or coordinator to ask; 2 usage (click's); 3 the coordinator did not answer
(unreachable, wrong peer token); 5 the coordinator refused (node-rank 0, a rank
out of range, another job: the reason is printed).
"""

from __future__ import annotations

from typing import Any

import click
import grpc

from tierfs.cli.console import fail
from tierfs.cli.status_file import STATUS_TIMEOUT, DaemonNotAnswering, not_answering, read_status
from tierfs.core import settings
from tierfs.rpc import peer_pb2, peer_pb2_grpc
from tierfs.rpc import wire as peer_wire

#: exit codes of ``tierfs nodes gone`` besides 0 and 1 (see the module docstring)
REFUSED_EXIT = 5
UNREACHABLE_EXIT = 3

#: seconds the Gone call may take
GONE_TIMEOUT = 15.0


def _target(status: dict[str, Any], coordinator: str | None) -> tuple[str, str]:
    """(job name, coordinator address) from the mount's status (``coordinator``
    overrides the address). Ends the command (exit 1) when either is unknown."""
    job = status.get("job") or {}
    name = job.get("name") if isinstance(job, dict) else None
    if not name:
        fail("the mount runs no job yet (no job name in its status): nothing to declare")
    peer = (status.get("tiers") or {}).get("peer") or status.get("peer") or {}
    address = coordinator or (peer.get("coordinator") if isinstance(peer, dict) else None)
    if not address:
        fail(
            "the mount does not know its coordinator yet (a single-node job or the "
            "rendezvous is not done); pass --coordinator HOST:PORT"
        )
    return str(name), str(address)


@click.group("nodes")
def nodes() -> None:
    """Membership of the job's nodes."""


@nodes.command("gone")
@click.argument("mountpoint", type=str)  # not click.Path: its stat waits on a stuck daemon
@click.argument("ranks", nargs=-1, type=int, required=True)
@click.option(
    "--peer-token",
    envvar=settings.PEER_TOKEN.name,
    help="The job's peer token (default: $TIERFS_PEER_TOKEN).",
)
@click.option("--coordinator", help="HOST:PORT of node-rank 0 (default: the mount's).")
@click.option("--reason", default="tierfs nodes gone", help="Why (logged by the coordinator).")
def gone_cmd(
    mountpoint: str,
    ranks: tuple[int, ...],
    peer_token: str | None,
    coordinator: str | None,
    reason: str,
) -> None:
    """Declare node RANKs gone for good for the job's current generation.

    Restore, sync and backup rounds stop waiting for them and replication picks
    stand-ins; a gone node that comes back is refused until the job restarts
    with another --nodes. Exit 5: refused (reason printed); 3: no answer.
    """
    try:
        status = read_status(mountpoint, STATUS_TIMEOUT)
    except DaemonNotAnswering:
        fail(not_answering(mountpoint, STATUS_TIMEOUT))
    job, address = _target(status, coordinator)
    request = peer_pb2.GoneRequest(job=job, ranks=list(ranks), reason=reason)
    with grpc.insecure_channel(address) as channel:
        stub = peer_pb2_grpc.CoordinatorStub(channel)
        try:
            reply = stub.Gone(
                request, metadata=peer_wire.metadata(peer_token), timeout=GONE_TIMEOUT
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                click.echo(f"tierfs: error: the coordinator refused: {detail}", err=True)
                raise SystemExit(REFUSED_EXIT) from None
            name = code.name if code is not None else "error"
            click.echo(f"tierfs: error: coordinator {address}: {name}: {detail}", err=True)
            raise SystemExit(UNREACHABLE_EXIT) from None
    click.echo(
        f"job {job} generation {reply.generation} ({reply.nodes} nodes): gone {sorted(reply.gone)}"
    )
    if reply.live:
        click.echo(
            f"tierfs: warning: node-rank(s) {sorted(reply.live)} still sent heartbeats a "
            "moment ago: declared gone anyway; while this generation lasts their daemons "
            "are refused and rounds no longer wait for them (only a restart of the job "
            "with another node count, --nodes, takes them back)",
            err=True,
        )
