"""The control plane: Ray actors that register jobs, allocate storage and supervise servers.

The actor classes here are plain Python classes; :mod:`pocketflow.cluster` turns them into Ray
actors when it launches a cluster, so that importing this package never imports Ray. Policies are
pure functions in their own modules (:mod:`pocketflow.control.hints`,
:mod:`pocketflow.control.packing`, :mod:`pocketflow.control.sizing`).
"""

from __future__ import annotations

NAMESPACE = "pocketflow"
"""Ray namespace of every pocketflow actor."""

CONTROLLER_ACTOR_NAME = "pocketflow-controller"
"""Name of the ``Controller`` actor, how other drivers of the Ray cluster find it."""

METADATA_ACTOR_NAME = "pocketflow-metadata"
"""Name of the ``Metadata`` actor."""

STORAGE_NODE_ACTOR_PREFIX = "pocketflow-node-"
"""Prefix of each ``StorageNode`` actor's name; the node id follows."""

__all__ = [
    "NAMESPACE",
    "CONTROLLER_ACTOR_NAME",
    "METADATA_ACTOR_NAME",
    "STORAGE_NODE_ACTOR_PREFIX",
]
