"""The one size parser (tierfs/core/sizes.py): Kubernetes quantity semantics everywhere.

`tierfs mount --size`, the config file, `tierfs csi --size` (and its
--resize-ram-volume) and a CheckpointConfiguration's spec.inMemoryVolumeSize
give the same bytes for the same text.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tierfs.core import sizes
from tierfs.core.config import ConfigError, load_config_file, parse_size
from tierfs.core.sizes import (
    BINARY_SUFFIXES,
    DECIMAL_SUFFIXES,
    KUBERNETES_PATTERN,
    SizeError,
    decimal_note,
    format_quantity,
)
from tierfs.csi import cli as csi_cli
from tierfs.csi import render

REPO = Path(__file__).resolve().parents[2]
GiB, MiB, KiB = 2**30, 2**20, 2**10


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8Gi", 8 * GiB),
        ("8G", 8 * 10**9),
        ("512Mi", 512 * MiB),
        ("512M", 512 * 10**6),
        ("1.5Gi", 3 * 2**29),
        ("1.5G", 1_500_000_000),
        ("4096", 4096),
        (" 4096 ", 4096),
        ("1k", 1000),
        ("1Ki", 1024),
        ("100k", 100_000),
        ("2Ti", 2 * 2**40),
        ("2T", 2 * 10**12),
        ("1Pi", 2**50),
        ("1P", 10**15),
        ("1Ei", 2**60),
        ("1E", 10**18),
        ("0.5Ki", 512),
        ("0.5k", 500),
        ("+3Mi", 3 * MiB),
        ("1.000Gi", GiB),
        ("007", 7),
        # tierfs's own spellings (unchanged meaning): B-suffixed and with a space
        ("8GiB", 8 * GiB),
        ("512MiB", 512 * MiB),
        ("1023KiB", 1023 * KiB),
        ("100TiB", 100 * 2**40),
        ("10GB", 10 * 10**9),
        ("10KB", 10_000),
        ("10kB", 10_000),
        ("4096B", 4096),
        ("8 GiB", 8 * GiB),
        ("8 Gi", 8 * GiB),
        (4096, 4096),
    ],
)
def test_exact_inputs(text, expected):
    assert sizes.parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", ["is empty", "Ki Mi Gi"]),
        ("   ", ["is empty"]),
        ("-1Gi", ["'-1Gi'", "negative"]),
        ("-5GiB", ["negative"]),
        ("0", ["'0'", "positive"]),
        ("0Gi", ["positive"]),
        (0, ["positive"]),
        (-4, ["positive"]),
        ("1.5", ["'1.5'", "1.5 bytes", "whole number"]),
        ("0.3Ki", ["307.2 bytes", "whole number"]),
        ("8g", ["unknown suffix 'g'", "case-sensitive", "did you mean G?"]),
        ("8gi", ["did you mean Gi?"]),
        ("8gib", ["did you mean GiB?"]),
        ("8K", ["unknown suffix 'K'", "Ki for 1024, k for 1000"]),
        ("8m", ["unknown suffix 'm'", "milli"]),
        ("12XB", ["unknown suffix 'XB'", "Ki Mi Gi Ti Pi Ei"]),
        ("1e9", ["'1e9'", "not a size"]),
        ("1.2.3G", ["not a size"]),
        ("lots", ["not a size", "e.g. 8Gi"]),
        ("8 G i", ["not a size"]),
        (True, ["not a size"]),
        (1.5, ["not a size"]),
    ],
)
def test_errors_name_the_value_and_the_forms(text, words):
    with pytest.raises(SizeError) as info:
        sizes.parse_size(text, "--size")
    message = str(info.value)
    assert message.startswith("--size")
    for word in words:
        assert word in message


@pytest.mark.parametrize("text", ["8GiB", "8 Gi", " 8Gi", "10GB", "4096B", "+1Gi", ".5Gi", ""])
def test_kubernetes_form_is_strict(text):
    """spec.inMemoryVolumeSize also becomes an emptyDir sizeLimit: only the CRD's pattern."""
    with pytest.raises(SizeError):
        sizes.parse_size(text, kubernetes=True)


@given(st.integers(min_value=1, max_value=2**70))
def test_format_then_parse_round_trips(n):
    text = format_quantity(n)
    assert re.fullmatch(KUBERNETES_PATTERN, text)
    assert sizes.parse_size(text) == n
    assert sizes.parse_size(text, kubernetes=True) == n
    assert len(text) <= len(str(n))


@given(
    st.integers(min_value=1, max_value=10**6),
    st.sampled_from(sorted({**BINARY_SUFFIXES, **DECIMAL_SUFFIXES})),
)
def test_number_and_suffix(k, suffix):
    factor = {**BINARY_SUFFIXES, **DECIMAL_SUFFIXES}[suffix]
    assert sizes.parse_size(f"{k}{suffix}") == k * factor
    if suffix in BINARY_SUFFIXES:
        assert sizes.parse_size(f"{k}{suffix}B") == k * factor


@given(
    st.integers(min_value=1, max_value=10**6),
    st.integers(min_value=1, max_value=3),
    st.sampled_from(sorted({**BINARY_SUFFIXES, **DECIMAL_SUFFIXES})),
)
def test_fractions_are_exact(units, places, suffix):
    """``1.5Gi`` is exactly 1.5·2³⁰; a fraction that is not whole bytes is refused."""
    factor = {**BINARY_SUFFIXES, **DECIMAL_SUFFIXES}[suffix]
    text = f"{units // 10**places}.{units % 10**places:0{places}d}{suffix}"
    exact = units * factor
    if exact % 10**places == 0:
        assert sizes.parse_size(text) == exact // 10**places
    else:
        with pytest.raises(SizeError, match="whole number of bytes"):
            sizes.parse_size(text)


def test_format_quantity_picks_the_shortest():
    assert format_quantity(8 * GiB) == "8Gi"
    assert format_quantity(8 * 10**9) == "8G"
    assert format_quantity(1536 * MiB) == "1536Mi"
    assert format_quantity(1_000_001) == "1000001"
    with pytest.raises(SizeError):
        format_quantity(0)


def test_decimal_note_says_what_8G_is():
    note = decimal_note("8G")
    assert note is not None
    assert note.startswith("--size 8G is 8000000000 bytes = 7.45 GiB")
    assert "write 8Gi for 8 GiB" in note
    assert "older tierfs read 8G as 8 GiB" in note
    assert decimal_note("1.5k", "size in c.yaml") == (
        "size in c.yaml 1.5k is 1500 bytes = 1.46 KiB: k is 10^3 as in Kubernetes (older "
        "tierfs read 1.5k as 1.5 KiB); write 1.5Ki for 1.5 KiB"
    )
    for unchanged in ("8Gi", "8GiB", "10GB", "4096", 4096):
        assert decimal_note(unchanged) is None


def test_the_crd_pattern_is_the_parsers():
    crd = yaml.safe_load((REPO / "deploy/base/crd-checkpointconfiguration.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    prop = schema["properties"]["spec"]["properties"]["inMemoryVolumeSize"]
    assert prop["pattern"] == KUBERNETES_PATTERN


@pytest.mark.parametrize("text", ["8G", "8Gi", "512Mi", "1.5Gi", "100k", "1073741824", "3Ti"])
def test_cli_config_file_and_csi_give_the_same_bytes(tmp_path, text):
    """Regression (issue 12): `--size 8G` was 8 GiB on the CLI but 8·10⁹ bytes through CSI."""
    expected = sizes.parse_size(text)
    # tierfs mount --size
    assert parse_size(text, "--size") == expected
    # the config file, under both keys
    for key in ("size", "inMemoryVolumeSize"):
        config = tmp_path / f"{key}.yaml"
        config.write_text(f"ramDir: /dev/shm/x\n{key}: '{text}'\n")
        assert load_config_file(str(config))["size"] == expected
        # tierfs csi --config (what --resize-ram-volume fits the volume to)
        assert csi_cli.configured_size({"config": str(config)}) == expected
    # tierfs csi --size
    assert csi_cli.configured_size({"size": text}) == expected
    # CheckpointConfiguration spec.inMemoryVolumeSize -> the DaemonSet's --size and sizeLimit
    assert render.quantity_bytes(text) == expected
    args = render.node_args({"inMemoryVolumeSize": text})
    assert f"--size={expected}" in args
    assert parse_size(args[args.index(f"--size={expected}")].split("=", 1)[1]) == expected


def test_config_file_notes_a_decimal_size(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("inMemoryVolumeSize: 64G\n")
    notes: list[str] = []
    assert load_config_file(str(config), notes)["size"] == 64 * 10**9
    assert len(notes) == 1
    assert notes[0].startswith(f"inMemoryVolumeSize in {config} 64G is 64000000000 bytes")


def test_config_file_size_error_names_the_key_and_file(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("size: 8g\n")
    with pytest.raises(
        ConfigError,
        match=rf"size in {re.escape(str(config))} '8g'.*did you "
        r"mean G\?",
    ):
        load_config_file(str(config))
