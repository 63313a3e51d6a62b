"""The tiers behind the RAM tier: local snapshots, peer replicas, GCS backups."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierfs.agent import NodeAgent


def attach_tiers(agent: NodeAgent) -> None:
    """Give ``agent`` its cluster and the tiers its configuration asks for.

    Without a peer plane (no ``--listen``/``--coordinator``) the node is a
    one-node cluster (:class:`tierfs.agent.LocalCluster`) and no tier follows
    its sealed steps. With one, the node gets a :class:`tierfs.tiers.peer.PeerTier`
    (replication, gRPC server) and a :class:`tierfs.tiers.peer_restore.PeerCluster`
    (restore rounds through the coordinator). The GCS tier comes last: it
    wraps the cluster, takes the peer tier's backup orders and, without
    ``--coordinator``, gives it the bucket rendezvous.
    """
    config = agent.config
    if config.listen or config.coordinator:
        from tierfs.tiers.peer import PeerTier
        from tierfs.tiers.peer_restore import PeerCluster

        tier = PeerTier(agent)
        agent.tiers.append(tier)
        agent.cluster = PeerCluster(tier)
    # the durable tier (off without --bucket); it wraps the cluster set above
    from tierfs.tiers.gcs_tier import attach_gcs

    attach_gcs(agent)
