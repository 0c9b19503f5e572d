"""Cluster membership (static or etcd) and rendezvous placement over storage nodes."""

from __future__ import annotations

from kvoffload.client_sdk.cluster.membership import (
    ClusterURL,
    EtcdMembership,
    Member,
    Membership,
    StaticMembership,
    open_membership,
    parse_cluster_url,
)
from kvoffload.client_sdk.cluster.placement import Placement

__all__ = [
    "ClusterURL",
    "EtcdMembership",
    "Member",
    "Membership",
    "Placement",
    "StaticMembership",
    "open_membership",
    "parse_cluster_url",
]
