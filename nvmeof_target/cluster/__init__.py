"""Cluster membership of a node: its `[cluster]` config and its registration in etcd."""
