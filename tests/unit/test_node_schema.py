"""The node settings schema (tierfs/core/config.py:NodeConfig, #12 item 5): every setting is
reachable from each place it may be given (flag, config-file key, CheckpointConfiguration
field, CSI volume attribute, variable), and a bad value is refused with a message naming
how it was given."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from tierfs.cli import main as cli_main
from tierfs.cli.options import SchemaCommand, mount_options
from tierfs.core import config, settings
from tierfs.core.config import FIELDS, FILE_KEYS, ConfigError, NodeConfig, build_config
from tierfs.csi import cli as csi_cli
from tierfs.csi import crd, render
from tierfs.csi import volume_context as vc

REPO = Path(__file__).resolve().parents[2]

#: one good value per setting: (as a flag gives it, as a config file gives it, the result)
SAMPLES: dict[str, tuple[object, object, object]] = {
    "mountpoint": (None, "/mnt/x", "/mnt/x"),
    "ram_dir": ("/dev/shm/r", "/dev/shm/r", "/dev/shm/r"),
    "size": ("8Gi", "8Gi", 8 << 30),
    "mount_options": (("ro", "noatime"), ["ro", "noatime"], ["ro", "noatime"]),
    "log_file": ("/tmp/l.log", "/tmp/l.log", "/tmp/l.log"),
    "log_level": ("debug", "warning", None),
    "job": ("llama", "llama", "llama"),
    "node_rank": (2, 2, 2),
    "nodes": (4, 4, 4),
    "peers_per_node": (1, 1, 1),
    # alone, with the default --nodes 1 (other values are checked against --nodes below)
    "peer_ranks": ("0", [0], [0]),
    "assume_data_parallelism": (1, 1, 1),
    "process_id": (3, 3, 3),
    "jax_coordinator": ("10.0.0.1:8476", "10.0.0.1:8476", "10.0.0.1:8476"),
    "seal_patterns": ((r"^s(?P<step>\d+)$",), r"^s(?P<step>\d+)$", [r"^s(?P<step>\d+)$"]),
    "keep_local": (3, 3, 3),
    "listen": ("0.0.0.0:7700", "0.0.0.0:7700", "0.0.0.0:7700"),
    "advertise": ("10.0.0.2:7700", "10.0.0.2:7700", "10.0.0.2:7700"),
    "data_port": (7701, 7701, 7701),
    "coordinator": ("10.0.0.3:7700", "10.0.0.3:7700", "10.0.0.3:7700"),
    "peer_token": ("s3cret", "s3cret", "s3cret"),
    "join_timeout": (12.5, 12.5, 12.5),
    "gone_after": (90.0, 90.0, 90.0),
    "heartbeat_group": (16, 16, 16),
    "bucket": ("b/p", "b/p", "b/p"),
    "backup_interval_minutes": (7.5, 7.5, 7.5),
    "backup_interval_steps": (10, 10, 10),
    "metrics_port": (9100, 9100, 9100),
}


def _flags(**given: object) -> dict[str, object]:
    return {f.dest: given.get(f.dest) for f in FIELDS}


def _write(tmp_path: Path, data: dict[str, object]) -> str:
    path = tmp_path / "tierfs.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_every_setting_has_a_sample_a_doc_and_a_place():
    assert set(SAMPLES) == {f.name for f in FIELDS} == set(NodeConfig.model_fields)
    for f in FIELDS:
        assert len(f.doc) > 10 and f.doc.endswith("."), f.name
        assert f.where.keys, f"{f.name} has no config-file key"


@pytest.mark.parametrize("field", [f for f in FIELDS if f.option], ids=lambda f: f.name)
def test_every_flag_reaches_its_setting(field):
    flag_value, _, expected = SAMPLES[field.name]
    extra = {"nodes": 4} if field.name in ("node_rank", "peer_ranks") else {}
    config = build_config({**_flags(**{k: v for k, v in extra.items()}), field.dest: flag_value})
    got = getattr(config, field.name)
    if field.name == "log_level":
        assert got == "DEBUG"
    else:
        assert got == expected


@pytest.mark.parametrize(
    "key, field",
    [(key, f) for f in FIELDS for key in f.where.keys],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_every_config_file_key_reaches_its_setting(tmp_path, key, field):
    _, file_value, expected = SAMPLES[field.name]
    data = {key: file_value}
    if field.name in ("node_rank", "peer_ranks"):
        data["nodes"] = 4
    config = build_config(_flags(), _write(tmp_path, data))
    got = getattr(config, field.name)
    assert got == ("WARNING" if field.name == "log_level" else expected)


def test_flags_win_over_the_file_and_mount_options_add_up(tmp_path):
    path = _write(tmp_path, {"keepLocal": 5, "mountOptions": "ro", "nodes": 3})
    config = build_config({**_flags(), "keep_local": 2, "option": ("noatime",)}, path)
    assert (config.keep_local, config.nodes) == (2, 3)
    assert config.mount_options == ["ro", "noatime"]


def test_the_peer_token_falls_back_to_its_variable(tmp_path):
    env = {settings.PEER_TOKEN.name: "from-env"}
    assert build_config(_flags(), env=env).peer_token == "from-env"
    assert build_config({**_flags(), "peer_token": "flag"}, env=env).peer_token == "flag"
    path = _write(tmp_path, {"peerToken": "file"})
    assert build_config(_flags(), path, env=env).peer_token == "file"
    for f in FIELDS:
        if f.where.env:
            assert f.where.env in settings.BY_NAME, f.where.env


@pytest.mark.parametrize(
    "dest, value, message",
    [
        ("keep_local", 0, "--keep-local must be >= 1, got 0"),
        ("nodes", 0, "--nodes must be >= 1, got 0"),
        ("node_rank", 1, "--node-rank must be in [0, 1), got 1"),
        ("peers_per_node", -1, "--peers-per-node must be >= 0, got -1"),
        ("peer_ranks", "1,x", "--peer-ranks[1] must be an integer, got 'x'"),
        ("listen", "nohost", "--listen must be HOST:PORT, got 'nohost'"),
        ("jax_coordinator", "h:99999", "--jax-coordinator must be HOST:PORT, got 'h:99999'"),
        ("size", "8g", "--size '8g': unknown suffix 'g'"),
        ("size", "512Ki", "--size 512.0 KiB is too small"),
        ("seal_pattern", ("^x$",), "--seal-pattern '^x$' needs a (?P<step>\\d+) group"),
        ("seal_pattern", ("(",), "bad --seal-pattern '('"),
        ("join_timeout", -1.0, "--join-timeout must be >= 0, got -1.0"),
        ("gone_after", 0.0, "--gone-after must be > 0, got 0.0"),
        ("backup_interval_minutes", 0.0, "--backup-interval-minutes must be > 0, got 0.0"),
        ("metrics_port", 70000, "--metrics-port must be <= 65535, got 70000"),
        ("log_level", "TRACE", "--log-level must be one of"),
    ],
)
def test_a_bad_flag_is_named(dest, value, message):
    with pytest.raises(ConfigError) as info:
        build_config({**_flags(), dest: value})
    assert str(info.value).startswith(message), str(info.value)


def test_peer_ranks_and_data_parallelism_the_cluster_cannot_use_are_refused(tmp_path):
    """Regression (a new-user trial): `--nodes 2 --peer-ranks 5 --assume-data-parallelism 3`
    mounted, then the peer tier logged "no peers: peer rank 5 must be in [0, 2)" forever
    and the status said "replicates to nobody"; replicator.yaml refuses the same values."""
    with pytest.raises(ConfigError) as info:
        build_config({**_flags(), "nodes": 2, "peer_ranks": "5"})
    assert str(info.value) == "--peer-ranks: peer rank 5 must be < nodes 2"
    with pytest.raises(ConfigError) as info:
        build_config({**_flags(), "nodes": 2, "assume_data_parallelism": 3})
    assert str(info.value) == "--assume-data-parallelism 3 must divide nodes 2"
    path = _write(tmp_path, {"nodes": 4, "peerRanks": [1, 4]})
    with pytest.raises(ConfigError) as info:
        build_config(_flags(), path)
    assert "peer rank 4 must be < nodes 4" in str(info.value)
    ok = build_config({**_flags(), "nodes": 4, "peer_ranks": "1,3", "assume_data_parallelism": 2})
    assert (ok.peer_ranks, ok.assume_data_parallelism) == ([1, 3], 2)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("keepLocal", 0, "keepLocal in {path} must be >= 1, got 0"),
        ("keepLocal", "two", "keepLocal in {path} must be an integer, got 'two'"),
        ("keepLocal", True, "keepLocal in {path} must be a number, got True"),
        ("nodes", 2.5, "nodes in {path} must be an integer, got 2.5"),
        ("inMemoryVolumeSize", "8g", "inMemoryVolumeSize in {path} '8g': unknown suffix"),
        ("inMemoryVolumeSize", "100k", "inMemoryVolumeSize in {path} 97.7 KiB is too small"),
        ("coordinator", "x", "coordinator in {path} must be HOST:PORT, got 'x'"),
        ("mountOptions", {"a": 1}, "mountOptions in {path} must be a list"),
        ("sealPatterns", "^x$", "sealPatterns in {path} '^x$' needs a (?P<step>\\d+) group"),
        ("logLevel", 3, "logLevel in {path} must be one of"),
        ("peerRanks", [1, -1], "peerRanks in {path}[1] must be >= 0, got -1"),
        ("peerToken", 12345, "peerToken in {path} must be a string, got <redacted>"),
        ("joinTimeoutSeconds", "soon", "joinTimeoutSeconds in {path} must be a number"),
    ],
)
def test_a_bad_config_file_value_names_the_key_and_the_file(tmp_path, key, value, message):
    path = _write(tmp_path, {key: value})
    with pytest.raises(ConfigError) as info:
        build_config(_flags(), path)
    assert str(info.value).startswith(message.format(path=path)), str(info.value)
    assert "12345" not in str(info.value)


def test_the_peer_token_never_shows_in_the_repr():
    env = {settings.PEER_TOKEN.name: "t"}
    config = build_config(_flags(), env=env)
    assert config.peer_token == "t"
    # the secret never shows in the config's repr
    assert "'t'" not in repr(config)


def test_unknown_config_file_key_lists_the_known_ones(tmp_path):
    path = _write(tmp_path, {"keepLokal": 2})
    with pytest.raises(ConfigError, match=r"unknown key 'keepLokal' \(known: .*keepLocal"):
        build_config(_flags(), path)


def test_file_keys_are_the_schemas_and_unchanged():
    """The config-file keys older releases documented all still work."""
    older = {
        "mountPoint", "ramDir", "inMemoryVolumeSize", "size", "mountOptions", "logFile",
        "logLevel", "job", "jobName", "nodeRank", "nodes", "peersPerNode", "peerRanks",
        "assumeDataParallelism", "processId", "jaxCoordinator", "sealPatterns", "keepLocal",
        "listen", "advertise", "dataPort", "coordinator", "peerToken", "joinTimeoutSeconds",
        "goneAfterSeconds",
        "heartbeatGroupSize",
        "cloudStorageBucketName", "bucket", "backupIntervalMinutes", "backupIntervalSteps",
        "metricsPort",
    }  # fmt: skip
    assert set(FILE_KEYS) == older


def test_the_daemons_json_round_trips():
    config = build_config(
        {**_flags(), "ram_dir": "/r", "size": "1Gi", "peer_token": "x", "peer_ranks": "0"}
    )
    config.mountpoint = "/m"
    again = NodeConfig.from_dict(config.to_dict())
    assert again == config and again.peer_token == "x" and again.size == 1 << 30
    assert NodeConfig.from_dict({**config.to_dict(), "from_a_newer_release": 1}) == config
    with pytest.raises(ConfigError, match="keep_local must be >= 1"):
        NodeConfig.from_dict({**config.to_dict(), "keep_local": 0})


# ------------------------------------------------------------------ the click options


def test_the_mount_options_are_the_schemas_flags():
    @click.command(cls=SchemaCommand)
    @mount_options
    def probe(**opts: object) -> None:
        pass

    names = {p.name for p in probe.params}
    assert names == {f.dest for f in FIELDS if f.option} | {"config"}
    mount = cli_main.main.commands["mount"]
    given = mount.make_context("mount", ["/m"]).params  # nothing given: no click default
    for f in FIELDS:
        if f.option:
            param = next(p for p in mount.params if p.name == f.dest)
            assert f.option in param.opts
            assert given[f.dest] in (None, ()), f"{f.option} has a click default"


def test_help_shows_each_flags_doc_and_default():
    text = " ".join(CliRunner().invoke(cli_main.main, ["mount", "--help"]).output.split())
    for f in FIELDS:
        if f.option:
            assert f.option in text
    assert "Sealed steps kept in RAM (default: 2)." in text
    assert "Shared secret on every peer call (or $TIERFS_PEER_TOKEN)." in text
    assert "(default: free space of the ram-dir's filesystem)" in text


def test_a_non_number_flag_is_still_a_usage_error(tmp_path):
    result = CliRunner().invoke(
        cli_main.main, ["mount", str(tmp_path), "--ram-dir", str(tmp_path), "--nodes", "x"]
    )
    assert result.exit_code == 2 and "'--nodes'" in result.output


def test_tierfs_csi_passes_every_flag_on_to_tierfs_mount():
    opts = {f.dest: SAMPLES[f.name][0] for f in FIELDS if f.option}
    argv, env = csi_cli.mount_argv(opts)
    assert env == {settings.PEER_TOKEN.name: "s3cret"}
    parsed = cli_main.main.commands["mount"].make_context("mount", ["/mnt", *argv])
    for f in FIELDS:
        if f.option and f.name != "peer_token":
            want = SAMPLES[f.name][0]
            got = parsed.params[f.dest]
            if f.name == "mount_options":
                assert got == (*want, "allow_other")
            elif f.name == "log_level":
                assert str(got).lower() == want
            else:
                assert got == (tuple(want) if isinstance(want, tuple) else want), f.name


# ------------------------------------------------------------ CRD and volume attributes


def test_every_crd_setting_reaches_its_flag():
    spec = {
        "inMemoryVolumeSize": "8Gi",
        "cloudStorageBucketName": "b/p",
        "mountOptions": ["ro"],
        "keepLocal": 3,
        "backupIntervalMinutes": 30,
        "logLevel": "DEBUG",
    }
    assert set(spec) == set(crd.SETTINGS)
    args = render.node_args(spec)
    assert f"--size={8 << 30}" in args and "--bucket=b/p" in args
    assert "--keep-local=3" in args and "--backup-interval-minutes=30" in args
    assert "--log-level=DEBUG" in args and args[args.index("ro") - 1] == "-o"
    # what the DaemonSet runs gives the same settings as the spec
    flags = [a for a in args if a.startswith(("--size", "--bucket", "--keep", "--backup", "--log"))]
    ctx = cli_main.main.commands["mount"].make_context(
        "mount", ["/mnt", *flags, "-o", "ro", "--ram-dir", "/r"]
    )
    config = build_config(ctx.params)
    assert (config.size, config.bucket, config.keep_local) == (8 << 30, "b/p", 3)
    assert (config.backup_interval_minutes, config.log_level) == (30.0, "DEBUG")
    assert config.mount_options == ["ro"]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("keepLocal", 0, "spec.keepLocal must be >= 1, got 0"),
        ("keepLocal", True, "spec.keepLocal must be a number, got True"),
        ("backupIntervalMinutes", -5, "spec.backupIntervalMinutes must be > 0, got -5"),
        ("logLevel", "TRACE", "spec.logLevel must be one of"),
        ("inMemoryVolumeSize", "8 Gi", "spec.inMemoryVolumeSize '8 Gi' is not a Kubernetes"),
        ("inMemoryVolumeSize", "8GiB", "spec.inMemoryVolumeSize '8GiB' is not a Kubernetes"),
        ("peerPort", 70000, "spec.peerPort must be <= 65535, got 70000"),
        ("extraArgs", [1], "spec.extraArgs[0] must be a string, got 1"),
        ("nodeSelector", {"a": 1}, "spec.nodeSelector"),
    ],
)
def test_a_bad_crd_field_is_named(field, value, message):
    spec = {"inMemoryVolumeSize": "8Gi", field: value}
    with pytest.raises(render.RenderError) as info:
        crd.parse_spec("x", spec)
    assert str(info.value).startswith(message), str(info.value)


def test_the_crd_and_the_model_have_the_same_fields():
    doc = yaml.safe_load((REPO / "deploy/base/crd-checkpointconfiguration.yaml").read_text())
    props = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    pod = {str(f.alias or name) for name, f in crd.PodFields.model_fields.items()}
    assert set(props["properties"]) == set(crd.SETTINGS) | pod
    # the CRD's own bounds are the schema's
    assert props["properties"]["keepLocal"]["minimum"] == 1
    assert set(props["properties"]["logLevel"]["enum"]) == set(config.LOG_LEVELS)


def test_volume_attributes_are_the_schemas():
    assert next(f.where.csi for f in FIELDS if f.name == "process_id") == vc.ATTR_PROCESS_ID
    assert next(f.where.csi for f in FIELDS if f.name == "jax_coordinator") == vc.ATTR_COORDINATOR
    assert vc.jax_init_info({"jaxProcessId": "3", "jaxCoordinatorAddress": "h"}).process_id == 3
    with pytest.raises(vc.ContextError, match=r"^volume attribute jaxProcessId must be >= 0"):
        vc.jax_init_info({"jaxProcessId": "-1", "jaxCoordinatorAddress": "h"})
    with pytest.raises(vc.ContextError, match="jaxProcessId must be an integer, got 'one'"):
        vc.jax_init_info({"jaxProcessId": "one", "jaxCoordinatorAddress": "h"})


def test_commands_that_need_no_settings_start_without_pydantic():
    """Start time (#12): pydantic doubled the CPU time of `tierfs --help`; only the
    commands that read settings load the schema."""
    code = (
        "import sys, tierfs.cli.main as m; "
        "assert not [n for n in sys.modules if n.startswith(('pydantic', 'yaml'))], "
        "sorted(n for n in sys.modules if n.startswith('pydantic'))[:5]; "
        "m.main.commands['mount'].params; "
        "assert 'pydantic' in sys.modules"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True, cwd="/")


def test_readme_table_matches_the_schema():
    """The README's node settings table is config.markdown_table() (regenerate with
    ``python -m tierfs.core.config``)."""
    readme = (REPO / "README.md").read_text()
    m = re.search(r"<!-- node-settings:start -->\n(.*?)<!-- node-settings:end -->", readme, re.S)
    assert m, "README.md lacks the node-settings table markers"
    assert m.group(1) == config.markdown_table()
