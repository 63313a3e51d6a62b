"""Which missing names of a DCP step a lookup waits for (pure policy, issue #14).

Stock ``torch.distributed.checkpoint`` on every rank runs ``dcp.save``, a barrier and
``dcp.load``. Each rank's files reach the other nodes' views only once that rank's
node sealed its part and the others learned of it, a moment after the save
returned. A lookup that answered ENOENT in that moment failed the load
(``FileNotFoundError``: DCP's ``CheckpointException`` is a ``BaseException``, so a
trainer catching ``Exception`` dies). So a lookup of a missing name waits, a few
seconds at most, when the name is one DCP's load needs and the directory shows
that the save which writes it has just finished:

* ``.metadata`` (written by the coordinator rank, last), in a directory holding
  this node's own DCP data files (``__<r>_<n>.distcp``), none of the coordinator
  rank's (``__0_*``), written less than :data:`EXPECT_FOR` s ago. This holds also
  before this node's own part is sealed (#14 trial 53 B1 (a): the node of a rank
  with a big file checksummed it at its close while the others already loaded).
* a DCP data file, in a directory holding own data files and a ``.metadata`` (the
  save is complete) newer than all of them and less than :data:`EXPECT_FOR` s old
  (#14 trial 53 B1 (b): ``.metadata`` was placed, the rank with the big file not
  yet known).

Only those names wait: the kernel looks a name up before it creates it, so a
node's own new files must never stall (a save into a new directory finds neither
rule true: no ``.metadata`` and no own data file yet, or, for the coordinator,
its own ``__0_*``). The node's view (:class:`tierfs.node.remote_view.RemoteView`)
also ends the wait once every rank's part of the step is known (the file would be
placed by then) and bounds it in all.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

#: DCP's metadata file, written by the coordinator rank (the part holding ``__0_*``)
DCP_METADATA = ".metadata"
#: a DCP data file: ``__<rank>_<n>.distcp``
DCP_DATA = re.compile(r"__\d+_\d+\.distcp\Z")
#: seconds after the writes that show a save just finished during which a lookup of
#: a missing name of it waits (the other ranks' parts come within a few seconds)
EXPECT_FOR = 10.0


def may_wait(name: str) -> bool:
    """Whether a lookup of ``name`` (one path component) may ever wait here."""
    return name == DCP_METADATA or DCP_DATA.match(name) is not None


@dataclass(frozen=True)
class DirLook:
    """One directory of the view, as a lookup of a missing name in it sees it.

    Attributes:
        own: this node's own regular files: name -> mtime (seconds since the epoch).
        placed: other ranks' files shown here: name -> mtime (seconds since the epoch).
    """

    own: Mapping[str, float]
    placed: Mapping[str, float]


def metadata_awaited(look: DirLook) -> bool:
    """Whether the directory ``look`` describes lacks the ``.metadata`` of a DCP save
    this node took part in: it holds this node's own DCP data files, none of the
    coordinator rank's (``__0_*``), and no ``.metadata`` (own or placed). Whatever
    their age: the node's view waits for it while another node reports saving that
    step directory (:mod:`tierfs.cluster.savers`, #14 trial 54 F2)."""
    data = [n for n in look.own if DCP_DATA.match(n)]
    if not data or any(n.startswith("__0_") for n in data):
        return False
    return DCP_METADATA not in look.own and DCP_METADATA not in look.placed


def expect_left(name: str, look: DirLook, now: float) -> float | None:
    """Seconds a lookup of ``name``, missing in the directory ``look`` describes, waits
    for another rank's part to bring it at most (``now``: seconds since the epoch);
    None when it is not expected (ENOENT at once). See the module docstring."""
    data = {n: m for n, m in look.own.items() if DCP_DATA.match(n)}
    if name == DCP_METADATA:
        if not metadata_awaited(look):
            return None
        since = max(data.values())
    elif DCP_DATA.match(name):
        if name in look.own or name in look.placed:
            return None
        meta = look.own.get(DCP_METADATA, look.placed.get(DCP_METADATA))
        if meta is None or not data or meta < max(data.values()):
            # no finished save here; or no own data file yet: a copy in name order
            # (``cp -r``, rsync: ``.metadata`` sorts first) creating its first one (a
            # CI run: a 10 s stall); or an older one (a save again in place)
            return None
        since = meta
    else:
        return None
    left = EXPECT_FOR - (now - since)
    return left if left > 0 else None
