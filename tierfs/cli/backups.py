"""``tierfs backups``: list, show and prune the GCS backup rounds of a job.

Registered by :func:`tierfs.cli.main._register_plugins`. Reads and writes the MTC
bucket layout (see :mod:`tierfs.backup.layout`); the bucket is reached
with google-cloud-storage's usual credentials (``STORAGE_EMULATOR_HOST``
selects an emulator). Tables go to stdout, progress bars to stderr.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click

from tierfs.cli.console import stdout_console
from tierfs.core import settings
from tierfs.core.config import ConfigError, format_size

_COMMON = [
    click.option(
        "--bucket",
        required=True,
        envvar=settings.BUCKET.name,
        metavar="NAME[/PREFIX]",
        help="The backup bucket (as given to tierfs mount --bucket).",
    ),
    click.option("--job", required=True, help="The job name (the directory under the bucket)."),
    click.option(
        "--nodes",
        type=click.IntRange(min=1),
        help="Nodes of the job (default: what the newest round with a tierfs "
        "manifest records, else the most ranks any round of the job holds).",
    ),
]


def _common(f: Any) -> Any:
    for d in reversed(_COMMON):
        f = d(f)
    return f


def _backend(bucket: str) -> Any:
    from tierfs.backup.bucket import GcsBackend
    from tierfs.backup.layout import LayoutError, parse_bucket

    try:
        spec = parse_bucket(bucket)
    except LayoutError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        return GcsBackend(spec)
    except ConfigError as exc:  # a malformed TIERFS_GCS_* variable
        raise click.ClickException(str(exc)) from None
    except Exception as exc:  # credentials, client construction
        raise click.ClickException(f"cannot reach {spec}: {exc}") from None


def _guard(fn: Callable[[], Any]) -> Any:
    """Run a bucket operation; turn library errors into one-line CLI failures."""
    from tierfs.backup.bucket import describe_error

    try:
        return fn()
    except click.ClickException:
        raise
    except Exception as exc:
        raise click.ClickException(describe_error(exc)) from None


def _progress() -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not sys.stderr.isatty(),
    )


def _load_rounds(backend: Any, job: str, nodes: int | None) -> list[Any]:
    with _progress() as progress:
        task = progress.add_task("reading rounds", total=None)
        return _guard(
            lambda: backend.list_rounds(
                job,
                nodes,
                on_names=lambda names: progress.update(task, total=len(names)),
                on_round=lambda _info: progress.advance(task),
            )
        )


def _nodes_text(info: Any) -> str:
    step = info.step_for_display()
    if step is None:
        return f"0/{info.nodes}"
    present = info.ranks_present(step)
    if len(present) == info.nodes and present == list(range(info.nodes)):
        return f"{len(present)}/{info.nodes}"
    shown = ",".join(map(str, present[:8])) + ("…" if len(present) > 8 else "")
    return f"{len(present)}/{info.nodes} ({shown or '-'})"


def round_row(info: Any, forced: str | None, loads: str | None = None) -> dict[str, Any]:
    """One round as plain data (``list --json``); ``loads``: whether its complete step
    would load (:func:`tierfs.backup.round_verdict.round_loads`)."""
    step = info.step_for_display()
    return {
        "round": info.name,
        "step": step,
        "complete": info.complete,
        "loads": loads,
        "nodes": info.nodes,
        "ranks_present": info.ranks_present(step) if step is not None else [],
        "bytes": info.total_bytes,
        "objects": len(info.objects),
        "restore_version": info.name == forced,
        "error": info.error,
        "problems": [] if info.complete else info.problems()[:5],
    }


@click.group("backups")
def backups() -> None:
    """List, inspect and prune GCS backups (gs://BUCKET/[PREFIX/]JOB/<UTC round>/)."""


@backups.command("list")
@_common
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_cmd(bucket: str, job: str, nodes: int | None, as_json: bool) -> None:
    """Every backup round of JOB: step, nodes present, complete or not, size."""
    backend = _backend(bucket)
    forced = _guard(lambda: backend.read_restore_version(job))
    rounds = _load_rounds(backend, job, nodes)
    from tierfs.backup.round_verdict import round_loads

    rows = [round_row(r, forced, round_loads(backend, job, r)) for r in rounds]
    if as_json:
        click.echo(
            json.dumps(
                {
                    "bucket": str(backend.spec),
                    "job": job,
                    "restore_version": forced,
                    "rounds": rows,
                },
                indent=2,
            )
        )
        return
    from rich.table import Table

    console = stdout_console(markup=False)  # bucket object names, errors: not markup
    if not rounds:
        console.print(
            f"no backup rounds under {backend.spec}{job}/", highlight=False, soft_wrap=True
        )
    else:
        table = Table(title=f"backups of {job} in {backend.spec}")
        for col in ("round", "step", "nodes", "complete", "size", "objects"):
            table.add_column(col, no_wrap=True)
        table.add_column("loads")
        table.add_column("note")
        for info, row in zip(rounds, rows, strict=True):
            note = "restore.version" if row["restore_version"] else ""
            if info.error:
                note = (note + " " + info.error).strip()
            elif not info.complete:
                note = (note + " " + "; ".join(row["problems"][:1])).strip()
            table.add_row(
                info.name,
                "-" if row["step"] is None else str(row["step"]),
                _nodes_text(info),
                "yes" if info.complete else "no",
                format_size(info.total_bytes),
                str(len(info.objects)),
                row["loads"] or "-",
                note,
            )
        console.print(table)
    if forced is not None:
        console.print(f"restore.version: {forced}", highlight=False, soft_wrap=True)


@backups.command("show")
@click.argument("round_name", metavar="ROUND")
@_common
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def show_cmd(round_name: str, bucket: str, job: str, nodes: int | None, as_json: bool) -> None:
    """One round in detail: every node's pointer, hash, size and problems."""
    from tierfs.backup.layout import LayoutError, check_round_name

    try:
        check_round_name(round_name)
    except LayoutError as exc:
        raise click.ClickException(str(exc)) from None
    from tierfs.backup.round_verdict import round_loads

    backend = _backend(bucket)
    forced = _guard(lambda: backend.read_restore_version(job))
    info = _guard(lambda: backend.inspect_round_of_job(job, round_name, nodes))
    if not info.objects:
        raise click.ClickException(f"no round {round_name} under {backend.spec}{job}/")
    parts = []
    for (rank, step), e in sorted(info.parts.items()):
        parts.append(
            {
                "rank": rank,
                "step": step,
                "complete": e.complete,
                "hashes": {str(w): h for w, h in sorted(e.metas.items())},
                "bytes": e.bytes,
                "files": (len(e.backup.objects) if e.backup else None),
                "uploader": e.backup.uploader if e.backup else None,
                "written_by": "tierfs" if e.backup else "other (no tierfs manifest)",
                "problems": e.missing,
            }
        )
    data = {
        **round_row(info, forced, round_loads(backend, job, info)),
        "complete_step": info.complete_step,
        "problems": info.problems() if not info.complete else [],
        "parts": parts,
    }
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    from rich.table import Table

    console = stdout_console(markup=False)  # bucket object names, errors: not markup
    state = f"complete (step {info.complete_step})" if info.complete else "INCOMPLETE"
    if data["loads"]:
        state += f", loads: {data['loads']}"
    console.print(
        f"round {info.name} of {job} in {backend.spec}: {state}; "
        f"{len(info.objects)} objects, {format_size(info.total_bytes)}"
        + ("; named in restore.version" if forced == info.name else ""),
        highlight=False,
        soft_wrap=True,
    )
    table = Table()
    for col in ("rank", "step", "complete", "hash", "files", "size"):
        table.add_column(col, no_wrap=True)
    table.add_column("problems")
    for p in parts:
        hashes = ", ".join(f"w{w}:{(h or '?')[:13]}…" for w, h in p["hashes"].items()) or "-"
        table.add_row(
            str(p["rank"]),
            str(p["step"]),
            "yes" if p["complete"] else "no",
            hashes,
            "-" if p["files"] is None else str(p["files"]),
            format_size(p["bytes"]),
            "; ".join(p["problems"][:2]),
        )
    console.print(table)
    for line in data["problems"]:
        console.print(f"  {line}", highlight=False, soft_wrap=True)


@backups.command("prune")
@_common
@click.option(
    "--keep-last", type=click.IntRange(min=0), default=0, help="Keep the N newest complete rounds."
)
@click.option(
    "--hourly",
    type=click.IntRange(min=0),
    default=0,
    help="Keep the newest complete round of each of the last N hours.",
)
@click.option(
    "--daily",
    type=click.IntRange(min=0),
    default=0,
    help="Keep the newest complete round of each of the last N days.",
)
@click.option(
    "--weekly",
    type=click.IntRange(min=0),
    default=0,
    help="Keep the newest complete round of each of the last N ISO weeks.",
)
@click.option(
    "--delete",
    "do_delete",
    is_flag=True,
    help="Really delete (without it, prune only prints what it would delete).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def prune_cmd(
    bucket: str,
    job: str,
    nodes: int | None,
    keep_last: int,
    hourly: int,
    daily: int,
    weekly: int,
    do_delete: bool,
    as_json: bool,
) -> None:
    """Opt-in retention: a dry run unless --delete is given.

    Never deletes the newest complete round, the round named in
    restore.version, or partial rounds newer than the newest complete one.
    """
    from tierfs.backup.retention import RetentionPolicy, RoundState, select_rounds

    policy = RetentionPolicy(keep_last, hourly, daily, weekly)
    if policy.empty:
        raise click.ClickException(
            "retention is opt-in: give --keep-last, --hourly, --daily and/or --weekly"
        )
    backend = _backend(bucket)
    forced = _guard(lambda: backend.read_restore_version(job))
    rounds = _load_rounds(backend, job, nodes)
    unreadable = [r.name for r in rounds if r.error]
    protected = {forced: "named in restore.version"} if forced else {}
    for name in unreadable:
        protected[name] = "could not be read"
    sel = select_rounds([RoundState(r.name, r.complete) for r in rounds], policy, protected)
    by_name = {r.name: r for r in rounds}
    plan = {
        "bucket": str(backend.spec),
        "job": job,
        "policy": policy.describe(),
        "dry_run": not do_delete,
        "keep": [{"round": n, "why": sel.keep[n]} for n in sorted(sel.keep, reverse=True)],
        "delete": [
            {"round": n, "complete": by_name[n].complete, "bytes": by_name[n].total_bytes}
            for n in sel.delete
        ],
    }
    if as_json and not do_delete:
        click.echo(json.dumps(plan, indent=2))
        return
    out = click.echo if not as_json else (lambda *a, **k: None)
    verb = "deleting" if do_delete else "would delete"
    for item in plan["keep"]:
        out(f"keep    {item['round']}  ({'; '.join(item['why'])})")
    for item in plan["delete"]:
        kind = "complete" if item["complete"] else "partial"
        out(
            f"{'delete' if do_delete else 'prune?'}  {item['round']}  ({kind}, "
            f"{format_size(item['bytes'])})"
        )
    total = sum(i["bytes"] for i in plan["delete"])
    out(
        f"{verb} {len(plan['delete'])} round(s), {format_size(total)}; "
        f"keeping {len(plan['keep'])}" + ("" if do_delete else " (dry run: add --delete)")
    )
    if not do_delete or not sel.delete:
        if as_json:
            click.echo(json.dumps(plan, indent=2))
        return
    deleted: dict[str, int] = {}
    with _progress() as progress:
        task = progress.add_task("deleting", total=None)
        for name in sel.delete:

            def listed(n: int, name: str = name) -> None:
                t = progress.tasks[0].total or 0
                progress.update(task, total=t + n, description=f"deleting {name}")

            deleted[name] = _guard(
                lambda name=name, listed=listed: backend.delete_round(
                    job, name, on_listed=listed, on_object=lambda _o: progress.advance(task)
                )
            )
    plan["deleted"] = deleted
    if as_json:
        click.echo(json.dumps(plan, indent=2))
    else:
        click.echo(f"deleted {len(deleted)} round(s), {sum(deleted.values())} objects")


@backups.command("restore-version")
@click.argument("round_name", metavar="[ROUND]", required=False)
@click.option(
    "--bucket",
    required=True,
    envvar=settings.BUCKET.name,
    metavar="NAME[/PREFIX]",
    help="The backup bucket.",
)
@click.option("--job", required=True, help="The job name.")
@click.option("--clear", is_flag=True, help="Delete restore.version.")
@click.option(
    "--force",
    is_flag=True,
    help="Set it even if the round is missing or incomplete (then every node starts from nothing).",
)
def restore_version_cmd(
    round_name: str | None, bucket: str, job: str, clear: bool, force: bool
) -> None:
    """Show, set (ROUND) or --clear gs://BUCKET/JOB/restore.version.

    While it exists every node of the job restores exactly that round, or
    nothing if it is missing or incomplete (PROTOCOL.md section 5).
    """
    from tierfs.backup.layout import LayoutError, check_round_name

    backend = _backend(bucket)
    if clear and round_name:
        raise click.ClickException("give ROUND or --clear, not both")
    if clear:
        existed = _guard(lambda: backend.delete_restore_version(job))
        click.echo("restore.version deleted" if existed else "no restore.version")
        return
    if round_name:
        try:
            check_round_name(round_name)
        except LayoutError as exc:
            raise click.ClickException(str(exc)) from None
        if not force:
            info = _guard(lambda: backend.inspect_round_of_job(job, round_name))
            if not info.objects:
                raise click.ClickException(
                    f"round {round_name} of job {job!r} does not exist (see 'tierfs backups "
                    "list'); --force sets it anyway"
                )
            if not info.complete:
                raise click.ClickException(
                    f"round {round_name} is incomplete; a restore from it would give every "
                    "node nothing; --force sets it anyway"
                )
        _guard(lambda: backend.write_restore_version(job, round_name))
        click.echo(f"restore.version = {round_name}")
        return
    current = _guard(lambda: backend.read_restore_version(job))
    click.echo(current if current is not None else "no restore.version")
