"""Byte sizes: one parser, with Kubernetes quantity semantics, for every place a size is given.

A size means the same bytes everywhere: ``tierfs mount --size``, ``size`` /
``inMemoryVolumeSize`` in a config file, ``tierfs csi --size`` (and its
``--resize-ram-volume``), and ``spec.inMemoryVolumeSize`` of a
``CheckpointConfiguration`` (the DaemonSet render and the operator).

The grammar is the Kubernetes resource quantity (k8s.io/apimachinery
``resource.Quantity``) restricted to byte counts: a non-negative decimal
number and an optional suffix, case-sensitive:

========================  ==============================
suffix                    factor
========================  ==============================
(none)                    1 (bytes)
``Ki Mi Gi Ti Pi Ei``     2¹⁰ 2²⁰ 2³⁰ 2⁴⁰ 2⁵⁰ 2⁶⁰
``k M G T P E``           10³ 10⁶ 10⁹ 10¹² 10¹⁵ 10¹⁸
========================  ==============================

So ``8Gi`` is 8 GiB and ``8G`` is 8·10⁹ bytes (7.45 GiB). Outside Kubernetes
objects tierfs also takes the spellings its older releases documented, whose
meaning is unambiguous and unchanged: ``KiB``…``EiB`` (= ``Ki``…``Ei``),
``kB``/``KB``, ``MB``…``EB`` (decimal, = ``k``…``E``), ``B`` (bytes), and
a space between number and suffix. Older releases read the bare letters
``K M G T P`` as binary; ``G`` now follows Kubernetes and ``K`` (not a
Kubernetes suffix) is refused; :func:`decimal_note` words the difference for
``tierfs mount`` to print.

Refused, with an error naming the value and the accepted forms: an empty
value, a negative or zero size, an unknown suffix (``8g``, ``8K``, ``8m``:
suffixes are case-sensitive, and ``m`` is Kubernetes' milli), exponent forms
(``1e9``), and a value that is not a whole number of bytes after scaling
(``1.5``, ``0.3Ki``).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Final

from tierfs.core.errors import ConfigurationError

__all__ = [
    "BINARY_SUFFIXES",
    "DECIMAL_SUFFIXES",
    "KUBERNETES_PATTERN",
    "SizeError",
    "decimal_note",
    "format_quantity",
    "parse_size",
]

#: Kubernetes binary suffixes -> factor
BINARY_SUFFIXES: Final[dict[str, int]] = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
#: Kubernetes decimal suffixes -> factor
DECIMAL_SUFFIXES: Final[dict[str, int]] = {
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
#: tierfs's own spellings (config files and flags only, never in a Kubernetes object)
_TIERFS_SUFFIXES: Final[dict[str, int]] = {
    "": 1,
    "B": 1,
    **{f"{s}B": f for s, f in BINARY_SUFFIXES.items()},
    **{f"{s}B": f for s, f in DECIMAL_SUFFIXES.items()},
    "KB": 10**3,
}
_ALL_SUFFIXES: Final[dict[str, int]] = {**BINARY_SUFFIXES, **DECIMAL_SUFFIXES, **_TIERFS_SUFFIXES}

#: the strict form, as the CRD's ``spec.inMemoryVolumeSize`` pattern spells it
KUBERNETES_PATTERN: Final = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
_KUBERNETES_RE: Final = re.compile(KUBERNETES_PATTERN)
_LOOSE_RE: Final = re.compile(
    r"^\s*(?P<sign>[+-]?)\s*(?P<num>[0-9]+(?:\.[0-9]+)?)\s*(?P<suffix>[A-Za-z]*)\s*$"
)

_FORMS: Final = (
    "a whole number of bytes, or a number with a Kubernetes suffix: "
    "Ki Mi Gi Ti Pi Ei (powers of 1024) or k M G T P E (powers of 1000), "
    "e.g. 8Gi, 512Mi, 1.5Gi, 8G (= 8·10⁹ bytes)"
)


class SizeError(ConfigurationError, ValueError):
    """A size cannot be parsed or is not a positive whole number of bytes.

    The message names the value (and ``what`` it was given as) and the accepted forms.
    """


def parse_size(value: str | int, what: str = "size", *, kubernetes: bool = False) -> int:
    """Bytes in a size such as ``8Gi`` (8·2³⁰), ``8G`` (8·10⁹), ``512Mi``, ``1.5Gi``, ``4096``.

    Args:
        value: the text (surrounding whitespace ignored), or an int (bytes; as YAML
            gives ``size: 4096``).
        what: how the value was given, for the error (``--size``,
            ``spec.inMemoryVolumeSize``).
        kubernetes: accept only the strict Kubernetes form (:data:`KUBERNETES_PATTERN`:
            no ``B`` spellings, no spaces), for values that also go into a
            Kubernetes object.

    Returns:
        The size in bytes, > 0.

    Raises:
        SizeError: empty, negative, zero, unknown suffix, not the strict form when
            ``kubernetes``, or not a whole number of bytes.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SizeError(f"{what} {value!r} is not a size: use {_FORMS}")
    if isinstance(value, int):
        if value <= 0:
            raise SizeError(f"{what} {value!r} must be a positive number of bytes")
        return value
    text = value.strip()
    if not text:
        raise SizeError(f"{what} is empty: use {_FORMS}")
    m = _LOOSE_RE.match(text)
    if not m:
        raise SizeError(f"{what} {value!r} is not a size: use {_FORMS}")
    if m.group("sign") == "-":
        raise SizeError(f"{what} {value!r} is negative: use {_FORMS}")
    suffix = m.group("suffix")
    factor = _ALL_SUFFIXES.get(suffix)
    if factor is None:
        raise SizeError(
            f"{what} {value!r}: unknown suffix {suffix!r}{_suffix_hint(suffix)}; use {_FORMS}"
        )
    if kubernetes and not _KUBERNETES_RE.match(value):
        raise SizeError(f"{what} {value!r} is not a Kubernetes quantity: use {_FORMS}")
    exact = Fraction(m.group("num")) * factor
    if exact.denominator != 1:
        raise SizeError(
            f"{what} {value!r} is {float(exact):.6g} bytes, not a whole number of bytes"
        )
    if exact <= 0:
        raise SizeError(f"{what} {value!r} must be positive")
    return int(exact)


def _suffix_hint(suffix: str) -> str:
    if suffix in ("m", "mi"):
        return " (m is milli in Kubernetes; suffixes are case-sensitive: Mi or M)"
    if suffix[:1] in ("K", "k") and suffix[1:] in ("", "i", "iB", "ib"):
        return " (suffixes are case-sensitive: Ki for 1024, k for 1000)"
    if suffix[:1] in "eE" and suffix[1:].isdigit():
        return " (exponent forms are not accepted)"
    for known in _ALL_SUFFIXES:
        if known.lower() == suffix.lower():
            return f" (suffixes are case-sensitive: did you mean {known}?)"
    return ""


def format_quantity(n: int) -> str:
    """The shortest exact Kubernetes quantity of ``n`` bytes (``8589934592`` -> ``8Gi``,
    ``8000000000`` -> ``8G``, ``1000001`` -> ``1000001``).

    Among the whole multiples of a suffix and plain bytes, the shortest text
    (binary before decimal on a tie); :func:`parse_size` gives ``n`` back.

    Raises:
        SizeError: ``n`` is not positive.
    """
    if n <= 0:
        raise SizeError(f"size {n!r} must be positive")
    candidates = [
        f"{n // f}{s}"
        for s, f in (*BINARY_SUFFIXES.items(), *DECIMAL_SUFFIXES.items())
        if n % f == 0
    ]
    return min([*candidates, str(n)], key=len)


def decimal_note(value: str | int, what: str = "--size") -> str | None:
    """One line for a size written with a bare decimal suffix (``8G``), else None.

    Older tierfs read ``8G`` as 8 GiB; now it is 8·10⁹ bytes as in Kubernetes.
    The line says how many bytes that is, in GiB, and the binary spelling.
    Only meaningful for a value :func:`parse_size` accepts.
    """
    if not isinstance(value, str):
        return None
    m = _LOOSE_RE.match(value)
    if not m or m.group("suffix") not in DECIMAL_SUFFIXES:
        return None
    suffix, num = m.group("suffix"), m.group("num")
    n = parse_size(value, what)
    binary = suffix.upper() + "i"
    unit, factor = max(
        ((s, f) for s, f in BINARY_SUFFIXES.items() if f <= n),
        key=lambda sf: sf[1],
        default=("", 1),
    )
    shown = f"{n / factor:.2f} {unit}B" if unit else f"{n} B"
    power = len(str(DECIMAL_SUFFIXES[suffix])) - 1
    older = "" if suffix == "E" else f" (older tierfs read {num}{suffix} as {num} {binary}B)"
    return (
        f"{what} {value.strip()} is {n} bytes = {shown}: {suffix} is 10^{power} as in "
        f"Kubernetes{older}; write {num}{binary} for {num} {binary}B"
    )
