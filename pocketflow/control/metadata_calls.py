"""Bounded calls from the controller to the ``Metadata`` actor (or a plain ``Metadata`` object)."""

from __future__ import annotations

import logging
import time
from typing import Any

from pocketflow.control.metadata import Metadata
from pocketflow.errors import ClusterError

log = logging.getLogger(__name__)

METADATA_CALL_TIMEOUT_S = 30.0
"""Deadline of one call to the ``Metadata`` actor (well inside the driver's controller deadline)."""

METADATA_CALL_ATTEMPTS_MAX = 64
"""Most attempts of one ``Metadata`` call while Ray restarts the actor (within the deadline)."""

METADATA_RETRY_PAUSE_S = 0.25
"""Pause between attempts of a ``Metadata`` call that found the actor dead or restarting."""


class MetadataCalls:
    """Calls ``Metadata`` methods by name, each within ``METADATA_CALL_TIMEOUT_S``.

    ``metadata`` is the ``Metadata`` actor's handle, or a plain :class:`Metadata` object (called
    directly) when the controller runs outside Ray.
    """

    def __init__(self, metadata: Any) -> None:
        self._metadata = metadata

    def __call__(self, method: str, *args: Any) -> Any:
        """``metadata.<method>(*args)``; a ``ClusterError`` when it does not answer in time."""
        if isinstance(self._metadata, Metadata):
            return getattr(self._metadata, method)(*args)
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        # While Ray restarts a dead Metadata actor (which replays its log), calls fail with
        # RayActorError; they are retried until the deadline. Every Metadata mutation may be
        # retried safely (put_job replaces, remove_job is called with missing_ok).
        deadline = time.monotonic() + METADATA_CALL_TIMEOUT_S
        for attempt in range(METADATA_CALL_ATTEMPTS_MAX):
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                break
            try:
                return ray.get(getattr(self._metadata, method).remote(*args), timeout=left_s)
            except GetTimeoutError:
                break
            except RayActorError as exc:
                log.warning("metadata.%s failed (attempt %d): %s", method, attempt + 1, exc)
                time.sleep(min(METADATA_RETRY_PAUSE_S, max(0.0, deadline - time.monotonic())))
        raise ClusterError(
            f"metadata.{method} did not answer within {METADATA_CALL_TIMEOUT_S:.0f}s"
        )
