"""tierfs on Kubernetes: the CSI node driver and the deployment around it.

Modules: :mod:`~tierfs.csi.server` (the gRPC server of the Identity and Node
services over the CSI v1 subset of ``tierfs/rpc/csi.proto``), with
:mod:`~tierfs.csi.identity`, :mod:`~tierfs.csi.node_service`,
:mod:`~tierfs.csi.targets` (target paths), :mod:`~tierfs.csi.records` (publish
records, in-flight locks) and :mod:`~tierfs.csi.abort` (errors as gRPC status);
:mod:`~tierfs.csi.mounts` (bind mounts and /proc/self/mountinfo),
:mod:`~tierfs.csi.volume_context` (volume attributes, redaction),
:mod:`~tierfs.csi.nodemount` (the node's tierfs mount, kept up),
:mod:`~tierfs.csi.cli` (``tierfs csi``), :mod:`~tierfs.csi.render` (the node
DaemonSet of a CheckpointConfiguration) and :mod:`~tierfs.csi.operator`
(optional, kopf). See docs/KUBERNETES.md.
"""
