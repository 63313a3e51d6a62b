"""A node's status as typed data (``tierfs status``, ``.tierfs/status.json``, metrics).

The agent assembles a :class:`NodeStatus` from the parts its tiers build
(:class:`PeerStatus` from the peer plane, :class:`BackupStatus` from the GCS
plane); the JSON is made from it at the one place it is written or served
(:meth:`NodeStatus.to_json`). That JSON is a contract: the CLI (``tierfs
status``/``wait``), the CSI node driver, the demo, the metrics exporter and
tests read it, and scripts may too. ``to_json`` keeps exactly its keys,
values and nesting; :meth:`NodeStatus.from_json` reads it back for the
readers, leniently: a key missing (a daemon of another version, a partial
status in a test) becomes its default, never an error.

Units: sizes are bytes (``*_bytes``, ``bytes``), durations seconds
(``*_seconds``, ``seconds``), points in time Unix time in seconds (``at``,
``since``, ``started``, ``counted_at``, ``waiting_until``).

The restore state and the backup rounds' records are mappings their owners
update with free-form keys (a phase, the round joined, the nodes missing...):
:class:`RestoreStatus` and :class:`BackupRoundStatus` keep every key as it
is and give the ones readers use as typed properties.

The types live by plane: :mod:`~tierfs.core.status.node` (:class:`NodeStatus`),
:mod:`~tierfs.core.status.parts` (the node's own parts), :mod:`~tierfs.core.status.peer`
(the peer tier), :mod:`~tierfs.core.status.cluster` (the coordinator's own status),
:mod:`~tierfs.core.status.backup` (the GCS tier) and :mod:`~tierfs.core.status.coding`
(the JSON coding they share). Import them from here.
"""

from tierfs.core.status.backup import (
    BackupRoundStatus,
    BackupStatus,
    BackupStepStatus,
    UploadStatus,
)
from tierfs.core.status.cluster import (
    ActiveBackupStatus,
    BackupBookStatus,
    CoordinatorMemberStatus,
    CoordinatorRoundStatus,
    CoordinatorStatus,
    CoordinatorSyncStatus,
)
from tierfs.core.status.coding import JsonObject, StatusFormatError
from tierfs.core.status.node import NodeStatus, TierStatus
from tierfs.core.status.parts import (
    BudgetStatus,
    FilesystemStatus,
    JobStatus,
    ReplicaStatus,
    RestoreStatus,
    StepStatus,
    UsageStatus,
)
from tierfs.core.status.peer import PeerMemberStatus, PeerStatus, PeerStepStatus, SyncStatus

__all__ = [
    "ActiveBackupStatus",
    "BackupBookStatus",
    "BackupRoundStatus",
    "BackupStatus",
    "BackupStepStatus",
    "BudgetStatus",
    "CoordinatorMemberStatus",
    "CoordinatorRoundStatus",
    "CoordinatorStatus",
    "CoordinatorSyncStatus",
    "FilesystemStatus",
    "JobStatus",
    "JsonObject",
    "NodeStatus",
    "PeerMemberStatus",
    "PeerStatus",
    "PeerStepStatus",
    "ReplicaStatus",
    "RestoreStatus",
    "StatusFormatError",
    "StepStatus",
    "SyncStatus",
    "TierStatus",
    "UploadStatus",
    "UsageStatus",
]
