"""pocketflow: elastic, ephemeral storage and shuffle for serverless analytics.

The public API::

    import pocketflow

    with pocketflow.LocalCluster() as cluster:                 # Ray + storage servers, locally
        with pocketflow.register_job("sort", {"data_size_bytes": "200MiB"}) as job:
            handle_json = job.handle.to_json()                 # what tasks receive
            with pocketflow.connect(handle_json) as pf:        # in any process, no Ray needed
                pf.create_bucket("shuffle")
                pf.put("shuffle", "part-0", b"...")

Importing this package does not import Ray; only starting or joining a cluster does. Every
public name but the errors is imported on first use: the cluster and job API (``LocalCluster``,
``register_job``, ``Job``, ``Hints``) and the client (``connect``, ``Client``, queues, append
files, listeners, handles). A task that only connects (a Lithops function runs in a fresh
process each time) does not pay for the control plane's modules, and one that imports a module
of the package for something else (``pocketflow.demo``'s records) does not pay for the client.
"""

from __future__ import annotations

from pocketflow.errors import (
    AlreadyExists,
    BucketExists,
    BucketNotFound,
    CapacityExhausted,
    ClientBusy,
    ClusterError,
    ConfigError,
    DataLost,
    DataUnavailable,
    FailedPrecondition,
    InternalError,
    InvalidRequest,
    JobNotRegistered,
    LeaseTableFull,
    NotFound,
    ObjectExists,
    ObjectNotFound,
    PermissionDenied,
    PersistNotSupported,
    PocketflowError,
    QueueFull,
    S3AccessDenied,
    S3BucketNotFound,
    S3Error,
    S3InvalidRequest,
    S3ObjectNotFound,
    S3Unavailable,
    ServerDraining,
    ServerStartError,
    ServerSuspect,
    StaleEpoch,
    TlsError,
    Unavailable,
)
from pocketflow.records import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

    from pocketflow.channels import AppendFile, Queue
    from pocketflow.client import Client, ObjectInfo, connect
    from pocketflow.cluster import LocalCluster
    from pocketflow.handle import JobHandle, ServerInfo
    from pocketflow.hints import Hints
    from pocketflow.job import Job, register_job
    from pocketflow.notifications import Event, Listener

__version__ = "0.1.0"

_LAZY = {"LocalCluster": "pocketflow.cluster", "register_job": "pocketflow.job",
         "Job": "pocketflow.job", "Hints": "pocketflow.hints",
         "connect": "pocketflow.client", "Client": "pocketflow.client",
         "ObjectInfo": "pocketflow.client", "Queue": "pocketflow.channels",
         "AppendFile": "pocketflow.channels", "Listener": "pocketflow.notifications",
         "Event": "pocketflow.notifications", "JobHandle": "pocketflow.handle",
         "ServerInfo": "pocketflow.handle"}
"""Public names imported on first use, and the module each comes from."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pocketflow' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "LocalCluster",
    "register_job",
    "Job",
    "Hints",
    "connect",
    "Client",
    "ObjectInfo",
    "Queue",
    "AppendFile",
    "Listener",
    "Event",
    "JobHandle",
    "ServerInfo",
    "PocketflowError",
    "NotFound",
    "ObjectNotFound",
    "BucketNotFound",
    "JobNotRegistered",
    "AlreadyExists",
    "ObjectExists",
    "BucketExists",
    "CapacityExhausted",
    "QueueFull",
    "LeaseTableFull",
    "InvalidRequest",
    "Unavailable",
    "ServerDraining",
    "ServerSuspect",
    "ClientBusy",
    "DataUnavailable",
    "DataLost",
    "PermissionDenied",
    "TlsError",
    "FailedPrecondition",
    "StaleEpoch",
    "PersistNotSupported",
    "InternalError",
    "ServerStartError",
    "ClusterError",
    "ConfigError",
    "S3Error",
    "S3ObjectNotFound",
    "S3BucketNotFound",
    "S3AccessDenied",
    "S3Unavailable",
    "S3InvalidRequest",
]
