"""The ``TIERFS_*`` environment variables (tierfs/core/settings.py): one table, read when used."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import tierfs
from tierfs.backup.bucket import GcsSettings, MiB
from tierfs.cluster import backup_schedule as gcs_schedule
from tierfs.core import settings
from tierfs.core.config import ConfigError
from tierfs.core.settings import ALL, BY_NAME, SettingError
from tierfs.csi import operator, render

REPO = Path(__file__).resolve().parents[2]

#: every variable and its default before the table existed (behaviour kept)
DEFAULTS = {
    "TIERFS_GCS_CHUNK_MIB": 64.0,
    "TIERFS_GCS_RETRY_DEADLINE": 300.0,
    "TIERFS_GCS_TIMEOUT": 120.0,
    "TIERFS_GCS_TICK": 1.0,
    "TIERFS_GCS_ROUND_TIMEOUT": 1800.0,
    "TIERFS_GCS_FALLBACK_DEADLINE": 30.0,
    "TIERFS_GCS_LOOKUP_DEADLINE": 20.0,
    "TIERFS_GCS_RENDEZVOUS_DEADLINE": 10.0,
    "TIERFS_GCS_START_DEADLINE": 5.0,
    "TIERFS_GCS_STALL_SECONDS": 20.0,
    "TIERFS_GCS_UPLOAD_RETRY_FIRST": 2.0,
    "TIERFS_GCS_UPLOAD_RETRY_MAX": 30.0,
    "TIERFS_GCS_DEDUP_WAIT": 60.0,
    "TIERFS_PEER_TOKEN": "",
    "TIERFS_PEER_PUSH_PATIENCE": 120.0,
    "TIERFS_EARLY_READ_MIB": 256.0,
    "TIERFS_EARLY_READ_WAIT": 0.5,
    "TIERFS_FETCH_BATCH": 64,
    "TIERFS_REVERIFY_AFTER": 600.0,
    "TIERFS_REFUSAL_GRACE": 30.0,
    "TIERFS_TRAINER_SAME_START": 60.0,
    "TIERFS_BUCKET": "",
    "TIERFS_IMAGE": render.IMAGE,
    "TIERFS_NAMESPACE": "tierfs-system",
    "TIERFS_DRIVER_NAME": "tierfs.csi.dev",
}


@pytest.fixture
def clean_env(monkeypatch):
    for name in BY_NAME:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_are_unchanged(clean_env):
    assert set(BY_NAME) == set(DEFAULTS) | {"TIERFS_GCS_THREADS"}
    for name, default in DEFAULTS.items():
        assert BY_NAME[name].get() == default, name
    assert settings.GCS_THREADS.get() == settings.default_threads()
    assert 2 <= settings.GCS_THREADS.get() <= 8
    assert gcs_schedule.ROUND_TIMEOUT == 1800.0
    assert f"tierfs:{tierfs.__version__}" == render.IMAGE


def test_empty_means_unset(clean_env):
    clean_env.setenv("TIERFS_GCS_TICK", "  ")
    clean_env.setenv("TIERFS_IMAGE", "")
    assert settings.GCS_TICK.get() == 1.0
    assert settings.IMAGE.get() == render.IMAGE


def test_read_when_used_not_at_import(clean_env):
    """Regression: the GCS tier's knobs were frozen when the module was imported."""
    assert settings.GCS_TICK.get() == 1.0
    clean_env.setenv("TIERFS_GCS_TICK", "0.5")
    assert settings.GCS_TICK.get() == 0.5
    clean_env.setenv("TIERFS_GCS_THREADS", "3")
    clean_env.setenv("TIERFS_GCS_CHUNK_MIB", "2.5")
    clean_env.setenv("TIERFS_GCS_RETRY_DEADLINE", "120")
    s = GcsSettings.from_env()
    assert (s.threads, s.chunk_size, s.retry_deadline) == (3, 10 * (MiB // 4), 120.0)
    assert GcsSettings.from_env(threads=5).threads == 5


def test_module_constants_are_gone():
    """Nothing keeps a copy of a variable's value from import time."""
    from tierfs.backup import bucket as gcs
    from tierfs.backup import tier as gcs_tier
    from tierfs.node import agreement
    from tierfs.replication import peer

    for module, names in [
        (
            gcs_tier,
            [
                "TICK",
                "ROUND_TIMEOUT",
                "FALLBACK_DEADLINE",
                "RESTORE_LOOKUP_DEADLINE",
                "RENDEZVOUS_DEADLINE",
                "START_DEADLINE",
                "STALL_SECONDS",
                "RETRY_FIRST",
                "RETRY_MAX",
            ],
        ),
        (gcs, ["DEDUP_WAIT"]),
        (peer, ["PUSH_PATIENCE"]),
        (agreement, ["REFUSAL_GRACE"]),
    ]:
        for name in names:
            assert not hasattr(module, name), f"{module.__name__}.{name}"


def _env_literals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"TIERFS_[A-Z0-9_]+", node.value)
    ]


def test_every_variable_is_in_the_table():
    """No module names a TIERFS_* variable of its own: it goes through settings.ALL."""
    found = {
        str(p.relative_to(REPO)): _env_literals(p)
        for p in (REPO / "tierfs").rglob("*.py")
        if p.name != "settings.py"
    }
    assert {k: v for k, v in found.items() if v} == {}
    in_table = set(_env_literals(REPO / "tierfs" / "core" / "settings.py"))
    assert in_table == set(BY_NAME)


@pytest.mark.parametrize(
    ("name", "raw", "words"),
    [
        ("TIERFS_GCS_TICK", "fast", ["TIERFS_GCS_TICK='fast'", "a number of seconds > 0"]),
        ("TIERFS_GCS_TICK", "0", ["out of range", "> 0"]),
        ("TIERFS_GCS_TICK", "-1", ["out of range"]),
        ("TIERFS_GCS_TICK", "nan", ["is not a number"]),
        ("TIERFS_GCS_TICK", "inf", ["is not a number"]),
        ("TIERFS_GCS_DEDUP_WAIT", "-0.5", ["out of range", ">= 0"]),
        ("TIERFS_GCS_THREADS", "4.0", ["TIERFS_GCS_THREADS='4.0'", "an integer >= 1"]),
        ("TIERFS_GCS_THREADS", "0", ["out of range", ">= 1"]),
        ("TIERFS_GCS_CHUNK_MIB", "0", ["a number of MiB > 0"]),
        ("TIERFS_REFUSAL_GRACE", "30s", ["TIERFS_REFUSAL_GRACE='30s'"]),
    ],
)
def test_bad_value_names_the_variable(clean_env, name, raw, words):
    clean_env.setenv(name, raw)
    with pytest.raises(SettingError) as info:
        BY_NAME[name].get()
    assert isinstance(info.value, ConfigError)
    for word in words:
        assert word in str(info.value)
    with pytest.raises(SettingError, match=name):
        settings.check_environment()


def test_zero_is_accepted_where_it_means_do_not_wait(clean_env):
    for name in ("TIERFS_GCS_DEDUP_WAIT", "TIERFS_PEER_PUSH_PATIENCE", "TIERFS_REFUSAL_GRACE"):
        clean_env.setenv(name, "0")
        assert BY_NAME[name].get() == 0.0


def test_check_environment_names_every_bad_variable():
    env = {"TIERFS_GCS_TICK": "x", "TIERFS_GCS_THREADS": "y", "TIERFS_GCS_TIMEOUT": "7"}
    assert len(list(settings.problems(env))) == 2
    with pytest.raises(SettingError) as info:
        settings.check_environment(env)
    assert "TIERFS_GCS_TICK='x'" in str(info.value)
    assert "TIERFS_GCS_THREADS='y'" in str(info.value)
    settings.check_environment({"TIERFS_GCS_TIMEOUT": "7", "TIERFS_PEER_TOKEN": "s3cret"})


def test_a_secret_is_never_in_an_error():
    secret = settings.Setting(
        "TIERFS_TEST_SECRET", int, 0, "", "a secret number", "tests", secret=True
    )
    with pytest.raises(SettingError) as info:
        secret.get({"TIERFS_TEST_SECRET": "hunter2"})
    assert "hunter2" not in str(info.value)
    assert "<redacted>" in str(info.value)


def test_operator_settings_come_from_the_table():
    assert operator.settings_from_env({}) == {
        "image": render.IMAGE,
        "namespace": render.NAMESPACE,
        "driver_name": render.DRIVER_NAME,
    }
    assert operator.settings_from_env({"TIERFS_NAMESPACE": "ns"})["namespace"] == "ns"


def test_readme_table_matches_the_module():
    """The README's table is settings.markdown_table() (regenerate with
    ``python -m tierfs.core.settings``)."""
    readme = (REPO / "README.md").read_text()
    m = re.search(r"<!-- settings:start -->\n(.*?)<!-- settings:end -->", readme, re.S)
    assert m, "README.md lacks the settings table markers"
    assert m.group(1) == settings.markdown_table()
    for s in ALL:
        assert s.doc and s.used_by and s.shown_default()
