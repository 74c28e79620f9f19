"""A multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``) for the scenario
scripts that need one (each imports this from its own folder)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster

from pocketflow.control import NAMESPACE
from pocketflow.control.loopback import keep_ray_on_loopback

OBJECT_STORE_BYTES = 80 * 1024 * 1024
"""Object store of each node: small, as on the 2-core machines the tests run on."""


def start_head(resources: dict[str, float]) -> Cluster:
    """A Ray head node (1 CPU) with ``resources``, its workers able to import this checkout."""
    keep_ray_on_loopback()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's workers must import pocketflow from this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p
    )
    return Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES, "resources": resources,
        },
    )


def add_node(cluster: Cluster, resources: dict[str, float], **node_args: Any) -> Any:
    """One more node (1 CPU) with ``resources`` (``node_ip_address=...`` and the like pass on)."""
    return cluster.add_node(
        num_cpus=1, object_store_memory=OBJECT_STORE_BYTES, resources=resources, **node_args
    )


def connect(cluster: Cluster) -> None:
    """Connect this process to ``cluster`` in pocketflow's namespace."""
    ray.init(
        address=cluster.address, namespace=NAMESPACE, log_to_driver=False,
        logging_level=logging.WARNING,
    )
