"""``tierfs backups list/show/prune/restore-version`` against the real fake-gcs-server."""

from __future__ import annotations

import datetime as dt
import json
import os
import re

import pytest
from click.testing import CliRunner
from conftest import tierfs
from gcs_fixtures import make_shard

from tierfs.backup import layout as L
from tierfs.backup.bucket import GcsBackend, GcsSettings
from tierfs.cli.main import main

T0 = dt.datetime(2025, 3, 3, 10, 0, tzinfo=dt.UTC)


def _name(minutes: int) -> str:
    return L.round_name(T0 + dt.timedelta(minutes=minutes))


@pytest.fixture
def rounds(fake_gcs, tmp_path):
    """A job of 2 nodes with rounds every 30 minutes over 5 hours; two of them partial.

    Returns (bucket, {round: complete}).
    """
    g = GcsBackend(fake_gcs.bucket, settings=GcsSettings.from_env(threads=4))
    shards = [
        make_shard(tmp_path / f"n{r}", "job", r, 5, {"5/a": b"x" * (100 + r), "5/b/c": b"y"})
        for r in (0, 1)
    ]
    state = {}
    bucket = fake_gcs.client().bucket(fake_gcs.bucket)
    for i in range(11):
        name = _name(30 * i)
        for s in shards:
            g.upload_shard(s, name, nodes=2)
        state[name] = True
    # one old partial round (pointer of rank 1 missing) and a newest one still "uploading"
    for name in (_name(30 * 3), _name(30 * 10)):
        bucket.blob(f"job/{name}/job-s5-n1-w0.meta").delete()
        state[name] = False
    return fake_gcs.bucket, state


def run(*args: str) -> str:
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def test_list_and_show(rounds):
    bucket, state = rounds
    out = run("backups", "list", "--bucket", bucket, "--job", "job", "--json")
    data = json.loads(out)
    rows = {r["round"]: r for r in data["rounds"]}
    assert list(rows) == sorted(state, reverse=True)
    for name, complete in state.items():
        assert rows[name]["complete"] is complete
        assert rows[name]["step"] == 5 and rows[name]["nodes"] == 2
    assert rows[_name(90)]["ranks_present"] == [0]
    assert rows[_name(0)]["ranks_present"] == [0, 1] and rows[_name(0)]["bytes"] > 201
    table = run("backups", "list", "--bucket", bucket, "--job", "job")
    line = next(ln for ln in table.splitlines() if _name(90) in ln)
    assert "no" in line and "1/2" in line
    shown = json.loads(
        run("backups", "show", _name(90), "--bucket", bucket, "--job", "job", "--json")
    )
    assert shown["complete"] is False
    assert "rank 1: no pointer for step 5" in shown["problems"]
    assert [p["rank"] for p in shown["parts"]] == [0, 1]
    text = run("backups", "show", _name(0), "--bucket", bucket, "--job", "job")
    assert "complete (step 5)" in text
    res = CliRunner().invoke(
        main, ["backups", "show", "2020-01-01_00-00", "--bucket", bucket, "--job", "job"]
    )
    assert res.exit_code == 1 and "no round" in res.output


def test_prune_dry_run_then_delete_exactly_that(rounds, fake_gcs):
    bucket, state = rounds
    args = ["backups", "prune", "--bucket", bucket, "--job", "job"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1 and "opt-in" in res.output
    # restore.version names an old complete round: it must survive
    run("backups", "restore-version", _name(30), "--bucket", bucket, "--job", "job")
    assert run("backups", "restore-version", "--bucket", bucket, "--job", "job").strip() == _name(
        30
    )
    before = {b.name for b in fake_gcs.client().list_blobs(bucket)}
    plan = json.loads(run(*args, "--keep-last", "2", "--hourly", "3", "--json"))
    assert plan["dry_run"] is True
    keep = {k["round"] for k in plan["keep"]}
    delete = [d["round"] for d in plan["delete"]]
    newest_complete = _name(270)
    assert newest_complete in keep and _name(30) in keep and _name(300) in keep
    # --keep-last 2: 270, 240; --hourly 3: the newest of hours 14, 13, 12
    assert keep == {_name(300), _name(270), _name(240), _name(210), _name(150), _name(30)}
    assert set(delete) == set(state) - keep
    assert _name(90) in delete  # old partial
    # the dry run changed nothing
    assert {b.name for b in fake_gcs.client().list_blobs(bucket)} == before
    text = run(*args, "--keep-last", "2", "--hourly", "3")
    assert "dry run" in text
    assert set(re.findall(r"prune\?\s+(\S+)", text)) == set(delete)
    out = run(*args, "--keep-last", "2", "--hourly", "3", "--delete")
    assert set(re.findall(r"^delete\s+(\S+)", out, re.M)) == set(delete)
    left = {b.name.split("/")[1] for b in fake_gcs.client().list_blobs(bucket)}
    assert left - {"restore.version"} == keep
    # pruning again deletes nothing more
    plan = json.loads(run(*args, "--keep-last", "2", "--hourly", "3", "--json"))
    assert plan["delete"] == []
    # even --keep-last 1 keeps the newest complete round and the restore.version one
    out = json.loads(run(*args, "--keep-last", "1", "--delete", "--json"))
    left = {b.name.split("/")[1] for b in fake_gcs.client().list_blobs(bucket)}
    assert {newest_complete, _name(30), _name(300)} <= left
    assert set(out["deleted"]) == {_name(240), _name(210), _name(150)}
    run("backups", "restore-version", "--clear", "--bucket", bucket, "--job", "job")
    assert "no restore.version" in run(
        "backups", "restore-version", "--bucket", bucket, "--job", "job"
    )


def test_cli_is_registered_and_reports_errors(fake_gcs):
    out = tierfs("backups", "list", "--bucket", fake_gcs.bucket, "--job", "job").stdout
    assert "no backup rounds" in out
    bad = tierfs("backups", "list", "--bucket", "Bad_Bucket!", "--job", "job", check=False)
    assert bad.returncode == 1 and "invalid bucket name" in bad.stderr
    fake_gcs.stop()
    env_deadline = {"TIERFS_GCS_RETRY_DEADLINE": "1"}
    down = tierfs(
        "backups",
        "list",
        "--bucket",
        fake_gcs.bucket,
        "--job",
        "job",
        check=False,
        env={**os.environ, **env_deadline},
    )
    assert down.returncode == 1 and "unreachable" in down.stderr


def test_restore_version_refuses_a_missing_or_incomplete_round(rounds):
    """Regression: naming a round that does not exist was accepted, and every later
    restart of the job then started from nothing."""
    bucket, _ = rounds
    base = ["backups", "restore-version", "--bucket", bucket, "--job", "job"]
    res = CliRunner().invoke(main, [*base[:2], "2026-11-30_15-22", *base[2:]])
    assert res.exit_code == 1 and "does not exist" in res.output
    res = CliRunner().invoke(main, [*base[:2], _name(90), *base[2:]])
    assert res.exit_code == 1 and "incomplete" in res.output
    assert "no restore.version" in run(*base)
    run(*base[:2], "2026-11-30_15-22", *base[2:], "--force")
    assert run(*base).strip() == "2026-11-30_15-22"


def _mtc_round(bucket, job: str, name: str, ranks, step: int = 7) -> None:
    """A round as MTC's replicator writes it: data and pointers, no .tierfs.json."""
    for r in ranks:
        h = "D" + f"{r + 1:x}" * 64
        bucket.blob(f"{job}/{name}/{h}.data/state/a").upload_from_string(b"a" * (10 + r))
        bucket.blob(f"{job}/{name}/{job}-s{step}-n{r}-w0.meta").upload_from_string(h)


def test_mtc_round_missing_its_last_rank_is_partial(fake_gcs):
    """Regression: for rounds without .tierfs.json the node count was the highest
    rank present + 1, so a round missing rank 2 of 3 showed "2/2" complete, and
    `prune --keep-last 1` kept it as the newest complete round and deleted the
    real newest complete one."""
    bucket = fake_gcs.client().bucket(fake_gcs.bucket)
    old, good, cut = _name(0), _name(30), _name(60)
    _mtc_round(bucket, "mtc", old, (0, 1, 2))
    _mtc_round(bucket, "mtc", good, (0, 1, 2))
    _mtc_round(bucket, "mtc", cut, (0, 1))  # rank 2 never wrote its part
    common = ["--bucket", fake_gcs.bucket, "--job", "mtc"]
    rows = {r["round"]: r for r in json.loads(run("backups", "list", *common, "--json"))["rounds"]}
    assert rows[cut]["complete"] is False and rows[cut]["nodes"] == 3
    assert rows[cut]["ranks_present"] == [0, 1]
    assert rows[good]["complete"] is True and rows[good]["nodes"] == 3
    table = run("backups", "list", *common)
    line = next(ln for ln in table.splitlines() if cut in ln)
    assert "2/3 (0,1)" in line and " no " in line
    shown = json.loads(run("backups", "show", cut, *common, "--json"))
    assert shown["complete"] is False and "rank 2: no pointer for step 7" in shown["problems"]
    plan = json.loads(run("backups", "prune", *common, "--keep-last", "1", "--json"))
    keep = {k["round"]: k["why"] for k in plan["keep"]}
    assert set(keep) == {good, cut}
    assert [d["round"] for d in plan["delete"]] == [old]
    res = CliRunner().invoke(main, ["backups", "restore-version", cut, *common])
    assert res.exit_code == 1 and "incomplete" in res.output
    # --nodes still wins
    rows = {
        r["round"]: r
        for r in json.loads(run("backups", "list", *common, "--nodes", "2", "--json"))["rounds"]
    }
    assert rows[cut]["complete"] is True and rows[cut]["nodes"] == 2


def test_mtc_round_is_judged_by_the_count_tierfs_rounds_record(fake_gcs, tmp_path):
    """A job whose tierfs rounds record 2 nodes: a newer MTC-written round holding
    only rank 0 is partial (not "1/1" complete)."""
    g = GcsBackend(fake_gcs.bucket, settings=GcsSettings.from_env(threads=4))
    for r in (0, 1):
        shard = make_shard(tmp_path / f"n{r}", "mix", r, 5, {"5/a": b"x" * (10 + r)})
        g.upload_shard(shard, _name(0), nodes=2)
    _mtc_round(fake_gcs.client().bucket(fake_gcs.bucket), "mix", _name(30), (0,))
    rounds = {r.name: r for r in g.list_rounds("mix")}
    assert rounds[_name(0)].complete and rounds[_name(0)].recorded_nodes == 2
    assert not rounds[_name(30)].complete and rounds[_name(30)].nodes == 2
    assert g.job_nodes("mix") == 2
    assert not g.inspect_round_of_job("mix", _name(30)).complete
    assert g.inspect_round_of_job("mix", _name(30), nodes=1).complete
