"""pocketflow: elastic, ephemeral storage and shuffle for serverless analytics.

The public API::

    import pocketflow

    with pocketflow.LocalCluster() as cluster:                 # Ray + storage servers, locally
        with pocketflow.register_job("sort", {"data_size_bytes": "200MiB"}) as job:
            handle_json = job.handle.to_json()                 # what tasks receive
            with pocketflow.connect(handle_json) as pf:        # in any process, no Ray needed
                pf.create_bucket("shuffle")
                pf.put("shuffle", "part-0", b"...")

Importing this package does not import Ray; only starting or joining a cluster does.
"""

from pocketflow.channels import AppendFile, Queue
from pocketflow.client import Client, ObjectInfo, connect
from pocketflow.cluster import LocalCluster
from pocketflow.errors import (
    AlreadyExists,
    BucketExists,
    BucketNotFound,
    CapacityExhausted,
    ClusterError,
    ConfigError,
    DataUnavailable,
    FailedPrecondition,
    InternalError,
    InvalidRequest,
    JobNotRegistered,
    NotFound,
    ObjectExists,
    ObjectNotFound,
    PermissionDenied,
    PersistNotSupported,
    PocketflowError,
    QueueFull,
    ServerDraining,
    ServerStartError,
    StaleEpoch,
    TlsError,
    Unavailable,
)
from pocketflow.handle import JobHandle, ServerInfo
from pocketflow.job import Hints, Job, register_job
from pocketflow.notifications import Event, Listener

__version__ = "0.1.0"

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
    "InvalidRequest",
    "Unavailable",
    "ServerDraining",
    "DataUnavailable",
    "PermissionDenied",
    "TlsError",
    "FailedPrecondition",
    "StaleEpoch",
    "PersistNotSupported",
    "InternalError",
    "ServerStartError",
    "ClusterError",
    "ConfigError",
]
