"""The controller's calls to ``StorageNode`` actors (Ray), each bounded: the only place the
control plane's role modules reach a node through Ray."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

NODE_CALL_TIMEOUT_S = 5.0
"""Deadline of asking a server's ``StorageNode`` actor whether its process still runs."""


class RayNodes:
    """Asks ``StorageNode`` actors about and for their servers.

    The role modules take this as a collaborator, so they run without Ray given another object
    with the same methods (tests give one that looks at the server process itself).
    """

    def process_runs(self, node: Any, node_id: str) -> bool:
        """Whether the server's process still runs, by its ``StorageNode`` actor (on the
        server's own machine). A missing actor, or one that cannot answer, counts as gone."""
        import ray

        if node is None:
            return False
        try:
            return bool(ray.get(node.alive.remote(), timeout=NODE_CALL_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - any failure to answer means gone
            log.info("the node of %s did not answer: %s", node_id, exc)
            return False

    def process_exited(self, node: Any, node_id: str) -> bool:
        """Whether the server's process is known to have ended: its ``StorageNode`` actor says
        so, or the actor itself is gone (the server exits with it). A node that does not answer
        in time says nothing (``False``): a slow actor on a loaded machine is no sign of an
        exit."""
        import ray
        from ray.exceptions import RayActorError

        if node is None:
            return True
        try:
            return not ray.get(node.alive.remote(), timeout=NODE_CALL_TIMEOUT_S)
        except RayActorError:
            return True
        except Exception as exc:  # noqa: BLE001 - no answer in time: unknown
            log.info("the node of %s did not answer: %s", node_id, exc)
            return False

    def stop(self, node: Any, node_id: str) -> None:
        """Ask the node to stop its server (not waited for)."""
        if node is None:
            return
        try:
            node.stop.remote()
        except Exception as exc:  # the actor itself is gone
            log.info("could not ask %s to stop: %s", node_id, exc)

    def stop_and_kill(self, node: Any, node_id: str) -> None:
        """Ask the node to stop its server and end the actor (a retired server)."""
        if node is None:
            return
        try:
            import ray

            node.stop.remote()
            ray.kill(node, no_restart=True)
        except Exception as exc:
            log.info("could not stop the node of %s: %s", node_id, exc)

    def start_heartbeats(self, node: Any, interval_ms: int) -> None:
        """Tell the node to send its server's heartbeats to the calling actor."""
        if node is None:
            return
        import ray

        node.start_heartbeats.remote(ray.get_runtime_context().current_actor, interval_ms)

    def stop_all(self, nodes: list[Any], *, timeout_s: float) -> None:
        """Stop the servers of ``nodes`` (waiting at most ``timeout_s``) and end the actors."""
        import ray

        try:
            ray.get([node.stop.remote() for node in nodes], timeout=timeout_s)
        except Exception as exc:
            log.warning("launched storage nodes did not stop cleanly: %s", exc)
        for node in nodes:
            try:
                ray.kill(node, no_restart=True)
            except Exception as exc:
                log.warning("could not kill a launched storage node: %s", exc)


class DirectNodes:
    """Calls ``StorageNode`` objects of this process directly: the nodes of a controller that
    runs outside Ray (tests of the role modules, tools). Such nodes push no heartbeats; the
    failure detector's probe of a silent server stands in for them."""

    def process_runs(self, node: Any, node_id: str) -> bool:
        """Whether the node's server process runs (``False`` without a node)."""
        return node is not None and bool(node.alive())

    def process_exited(self, node: Any, node_id: str) -> bool:
        """Whether the node's server process has ended (``True`` without a node)."""
        return node is None or not node.alive()

    def stop(self, node: Any, node_id: str) -> None:
        """Stop the node's server (by pid: SIGTERM, then SIGKILL)."""
        if node is not None:
            node.stop()

    def stop_and_kill(self, node: Any, node_id: str) -> None:
        self.stop(node, node_id)

    def start_heartbeats(self, node: Any, interval_ms: int) -> None:
        """Nothing: heartbeats travel through Ray."""

    def stop_all(self, nodes: list[Any], *, timeout_s: float) -> None:
        for node in nodes:
            node.stop()
