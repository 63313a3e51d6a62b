"""The tiers behind the RAM tier: local snapshots, peer replicas, GCS backups."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierfs.agent import NodeAgent


def attach_tiers(agent: NodeAgent) -> None:
    """Give ``agent`` its cluster and the tiers its configuration asks for.

    Without a peer plane (no ``--listen``/``--coordinator``) the node is a
    one-node cluster (:class:`tierfs.agent.LocalCluster`) and no tier follows
    its sealed steps.
    """
    return None
