"""Deleting what a Lithops executor stored, in the process that made it.

Lithops deletes a job's payloads and results by handing a request to its cleaner: one detached
process per machine that works through every request any Lithops process left in a shared
directory, sleeping 5 s after each prefix it deletes. A driver that relies on it leaves that
process running after it exits, for as long as other drivers' requests take (minutes, when
requests for storage that is gone pile up). A driver that owns its executor instead turns
``data_cleaner`` off and calls :func:`delete_executor_data` on the way out: one listing and one
delete per prefix of its own, done when the driver is.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NO_CLEANER", "delete_executor_data"]

NO_CLEANER: dict[str, Any] = {"lithops": {"data_cleaner": False}}
"""The ``extra`` of :func:`pocketflow.demo.lithops_config` for an executor whose data its
driver deletes itself."""

_JOBS_PREFIX = "lithops.jobs"
"""Where Lithops keeps an executor's functions (``<executor>/``) and its jobs' payloads,
statuses and results (``<executor>-<job>/``)."""


def delete_executor_data(fexec: Any) -> int:
    """Delete every object ``fexec`` (a ``lithops.FunctionExecutor``) stored under its own
    prefixes in Lithops' storage; the number deleted.

    The prefixes end in ``/`` and ``-`` so that executor ``abc-1`` never matches ``abc-10``'s
    keys. Call it once no call of the executor runs any more (after leaving its context).
    """
    storage = fexec.internal_storage.storage
    bucket = fexec.internal_storage.bucket
    deleted = 0
    for separator in ("/", "-"):
        keys = storage.list_keys(bucket, f"{_JOBS_PREFIX}/{fexec.executor_id}{separator}")
        if keys:
            storage.delete_objects(bucket, keys)
            deleted += len(keys)
    return deleted
