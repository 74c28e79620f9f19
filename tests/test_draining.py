"""Draining and retiring servers, with the ``Drainer`` role built without Ray over real
servers."""

from __future__ import annotations

from pathlib import Path

import pytest
from control_roles import register, roles
from fixtures_cluster import keys_on

from pocketflow.client import connect
from pocketflow.errors import ClusterError
from pocketflow.processes import wait_gone

EXIT_TIMEOUT_S = 10.0


def test_a_drained_server_keeps_its_data_readable_and_an_empty_one_retires_at_once(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        full = built.start("dr-0")
        empty = built.start("dr-1")
        built.start("dr-2")
        handle = register(built, "draining")
        with connect(handle, op_timeout_s="5s") as pf:
            pf.create_bucket("b")
            keys, _ = keys_on(handle, "dr-0", on_min=5)
            for key in keys:
                pf.put("b", key, key.encode())
            with built.lock:
                result = built.drainer.drain("dr-0")
            assert result["retired"] is False
            entry = next(s for s in built.jobs.record(handle.job_id).handle.servers
                         if s.node_id == "dr-0")
            assert entry.weight == 0.0, "a draining server takes no new data"
            assert "dr-0" in built.membership and built.membership.is_draining("dr-0")
            for key in keys:
                assert pf.get("b", key) == key.encode()

            with built.lock:
                result = built.drainer.drain("dr-1")
            assert result["retired"] is True
            assert not wait_gone([empty.server_process()], timeout_s=EXIT_TIMEOUT_S)
            assert "dr-1" not in built.membership
            assert all(s.node_id != "dr-1"
                       for s in built.jobs.record(handle.job_id).handle.servers)
            assert full.server_process().alive()
        with pytest.raises(ClusterError):
            with built.lock:
                built.drainer.drain("dr-1")

