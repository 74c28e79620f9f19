"""Tests of the Metadata actor: its records, its log and replay, its restart; job names."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from pocketflow.cluster import LocalCluster
from pocketflow.control.controller import validate_job_name
from pocketflow.control.metadata import Metadata, decode_records, encode_record
from pocketflow.errors import InvalidRequest, JobNotRegistered


def test_jobs_are_recorded_and_every_change_is_logged() -> None:
    metadata = Metadata()
    first = metadata.put_job({"job_id": "a-000001", "name": "a"})
    metadata.put_job({"job_id": "b-000002", "name": "b"})
    assert [j["job_id"] for j in metadata.jobs()] == ["a-000001", "b-000002"]
    assert metadata.get_job("a-000001")["name"] == "a"
    assert metadata.remove_job("a-000001")["name"] == "a"
    ops = metadata.ops()
    assert [(op["op"], op["job_id"]) for op in ops] == [
        ("register_job", "a-000001"),
        ("register_job", "b-000002"),
        ("deregister_job", "a-000001"),
    ]
    assert [op["seq"] for op in ops] == [first, first + 1, first + 2]
    assert [op["op"] for op in metadata.ops(since_seq=first + 1)] == ["deregister_job"]


def test_unknown_jobs_are_job_not_registered() -> None:
    metadata = Metadata()
    with pytest.raises(JobNotRegistered):
        metadata.get_job("nope")
    with pytest.raises(JobNotRegistered):
        metadata.remove_job("nope")
    assert metadata.ops() == []


@pytest.mark.parametrize("name", ["sort", "tpc-ds.q1", "A_b-9", "x" * 100])
def test_good_job_names(name: str) -> None:
    assert validate_job_name(name) == name


@pytest.mark.parametrize("name", ["", "-lead", "has space", "slash/y", "é", "x" * 101])
def test_bad_job_names(name: str) -> None:
    with pytest.raises(InvalidRequest):
        validate_job_name(name)


def test_controller_bounds_its_metadata_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung Metadata actor must surface as a ClusterError, not hang the controller (whose
    Metadata calls all go through MetadataCalls)."""
    import ray
    from ray.exceptions import GetTimeoutError

    from pocketflow.control.metadata_calls import MetadataCalls
    from pocketflow.errors import ClusterError

    class HungMetadata:
        class put_job:  # noqa: N801 - stands for an actor method
            @staticmethod
            def remote(*args: object) -> object:
                return object()

    def get(ref: object, *, timeout: float | None = None) -> object:
        if timeout is None:
            raise AssertionError("ray.get without a timeout would hang on a stuck actor")
        raise GetTimeoutError("timed out")

    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(ClusterError):
        MetadataCalls(HungMetadata())("put_job", {"job_id": "x"})


# -- the metadata log ---------------------------------------------------------------------------


def _record(job_id: str, **extra: object) -> dict[str, object]:
    return {"job_id": job_id, "name": job_id.split("-")[0], "epoch": 1, **extra}


def test_the_log_is_replayed_on_start(tmp_path: Path) -> None:
    path = tmp_path / "meta" / "metadata.log"
    metadata = Metadata(path)
    metadata.put_job(_record("a-000001"))
    metadata.put_job(_record("b-000002"))
    metadata.update_job("b-000002", {"epoch": 2, "weight_map": {"dram-0": 1.0}})
    last = metadata.remove_job("a-000001")
    assert last is not None
    metadata.close()

    again = Metadata(path)
    assert [j["job_id"] for j in again.jobs()] == ["b-000002"]
    assert again.get_job("b-000002")["epoch"] == 2
    assert again.get_job("b-000002")["weight_map"] == {"dram-0": 1.0}
    assert [op["op"] for op in again.ops()] == [
        "register_job", "register_job", "update_job", "deregister_job",
    ]
    assert again.log_info()["replayed"] == 4
    # Sequence numbers continue after the replayed ones instead of repeating them.
    assert again.put_job(_record("c-000003")) == again.ops()[-2]["seq"] + 1


def test_a_torn_last_record_is_ignored_and_cut_off(tmp_path: Path) -> None:
    path = tmp_path / "metadata.log"
    metadata = Metadata(path)
    metadata.put_job(_record("a-000001"))
    metadata.put_job(_record("b-000002"))
    metadata.close()
    whole = path.read_bytes()
    # The process died half-way through writing a third record: it was never acknowledged.
    torn = encode_record({"seq": 3, "op": "register_job", "job_id": "c", "record": {}})
    path.write_bytes(whole + torn[: len(torn) // 2])

    again = Metadata(path)
    assert [j["job_id"] for j in again.jobs()] == ["a-000001", "b-000002"]
    assert path.stat().st_size == len(whole)
    again.put_job(_record("d-000004"))
    again.close()
    assert [j["job_id"] for j in Metadata(path).jobs()] == ["a-000001", "b-000002", "d-000004"]


def test_a_record_with_a_bad_checksum_ends_the_replay(tmp_path: Path) -> None:
    first = encode_record({"seq": 1, "op": "register_job", "job_id": "a", "record": _record("a")})
    second = bytearray(
        encode_record({"seq": 2, "op": "register_job", "job_id": "b", "record": _record("b")})
    )
    second[-3] ^= 0x01  # flip a bit inside the JSON body
    records, offset = decode_records(first + bytes(second))
    assert [r["job_id"] for r in records] == ["a"]
    assert offset == len(first)
    assert decode_records(b"")[0] == []
    assert decode_records(b"garbage that is not a record\n") == ([], 0)


def test_the_log_is_compacted_past_its_bound(tmp_path: Path) -> None:
    path = tmp_path / "metadata.log"
    metadata = Metadata(path, compact_records_max=10)
    for i in range(25):
        metadata.put_job(_record(f"j{i}-{i:06d}"))
        if i % 2:
            metadata.remove_job(f"j{i}-{i:06d}")
    assert metadata.log_info()["records"] <= 10
    lines = path.read_bytes().count(b"\n")
    assert lines <= 10
    live = [j["job_id"] for j in metadata.jobs()]
    last_seq = metadata.ops()[-1]["seq"]
    metadata.close()

    again = Metadata(path)
    assert [j["job_id"] for j in again.jobs()] == live
    assert len(live) == 13
    assert again.put_job(_record("z-000099")) == last_seq + 1


def test_pending_job_ends_are_logged_replayed_and_compacted(tmp_path: Path) -> None:
    """A job removed with the servers that must still confirm its end keeps them in the log
    until they do, across a restart and a compaction."""
    path = tmp_path / "metadata.log"
    metadata = Metadata(path, compact_records_max=5)
    metadata.put_job(_record("a-000001"))
    metadata.put_job(_record("b-000002"))
    metadata.remove_job("a-000001", False, ["dram-1", "dram-0"])
    metadata.remove_job("b-000002", False, [])
    assert metadata.endings() == {"a-000001": ["dram-0", "dram-1"]}
    metadata.update_ending("a-000001", ["dram-1"])  # the fifth record: compacted
    assert metadata.log_info()["records"] == 1
    metadata.close()
    again = Metadata(path)
    assert again.endings() == {"a-000001": ["dram-1"]} and again.jobs() == []
    again.update_ending("a-000001", [])
    again.close()
    assert Metadata(path).endings() == {}


def test_remove_job_with_missing_ok_is_idempotent(tmp_path: Path) -> None:
    metadata = Metadata(tmp_path / "metadata.log")
    metadata.put_job(_record("a-000001"))
    assert metadata.remove_job("a-000001", missing_ok=True) is not None
    assert metadata.remove_job("a-000001", missing_ok=True) is None
    with pytest.raises(JobNotRegistered):
        metadata.update_job("a-000001", {"epoch": 3})


def test_a_killed_metadata_actor_is_restarted_with_every_acknowledged_change(
    local_cluster: LocalCluster,
) -> None:
    """Kill the Metadata actor's process in the middle of a job: Ray restarts it, it replays its
    log, nothing acknowledged is lost and the controller's calls meanwhile wait and succeed."""
    import ray

    from pocketflow.control import METADATA_ACTOR_NAME, NAMESPACE

    metadata = ray.get_actor(METADATA_ACTOR_NAME, namespace=NAMESPACE)
    before = ray.get(metadata.log_info.remote(), timeout=30)
    assert before["path"] == str(local_cluster.metadata_log)
    with local_cluster.register_job("meta-kill") as running:
        with running.connect() as client:
            client.create_bucket("b")
            client.put("b", "k", b"kept")
        acknowledged = {j["job_id"] for j in ray.get(metadata.jobs.remote(), timeout=30)}
        assert running.job_id in acknowledged

        os.kill(before["pid"], signal.SIGKILL)
        # Registered while Ray is restarting the actor: the controller's put_job waits for it.
        with local_cluster.register_job("meta-after") as later:
            after = ray.get(metadata.log_info.remote(), timeout=30)
            assert after["pid"] != before["pid"]
            assert after["replayed"] >= len(acknowledged)
            jobs = {j["job_id"] for j in ray.get(metadata.jobs.remote(), timeout=30)}
            assert acknowledged | {later.job_id} <= jobs
            with running.connect() as client:
                assert client.get("b", "k") == b"kept"
    jobs = {j["job_id"] for j in ray.get(metadata.jobs.remote(), timeout=30)}
    assert running.job_id not in jobs and later.job_id not in jobs


def test_the_log_is_compacted_past_its_byte_bound_without_fsync(tmp_path: Path) -> None:
    path = tmp_path / "metadata.log"
    metadata = Metadata(path, fsync=False, compact_bytes_max=4096)
    for i in range(40):
        metadata.put_job(_record(f"j{i}-{i:06d}", hints={"pad": "x" * 200}))
        metadata.remove_job(f"j{i}-{i:06d}")
    assert path.stat().st_size < 4096 + 1024
    metadata.put_job(_record("kept-000001"))
    metadata.close()
    assert [j["job_id"] for j in Metadata(path).jobs()] == ["kept-000001"]
    with pytest.raises(ValueError):
        Metadata(path, compact_records_max=0)


def test_the_sizing_history_is_logged_bounded_and_survives_replay_and_compaction(
    tmp_path: Path,
) -> None:
    """A restarted controller takes its sizing history back from here (issue 31 item 5)."""
    from pocketflow.control.metadata import SIZING_ACTIONS_KEPT_MAX

    path = tmp_path / "metadata.log"
    metadata = Metadata(path, compact_records_max=SIZING_ACTIONS_KEPT_MAX + 10)
    metadata.put_job({"job_id": "a-000001", "name": "a"})
    for i in range(SIZING_ACTIONS_KEPT_MAX + 5):
        metadata.record_sizing({"action": "AddServer", "node_id": f"dram-{i}",
                                "at_unix_s": float(i)})
    kept = metadata.sizing_actions()
    assert len(kept) == SIZING_ACTIONS_KEPT_MAX
    assert kept[-1]["node_id"] == f"dram-{SIZING_ACTIONS_KEPT_MAX + 4}"
    metadata.close()
    again = Metadata(path, compact_records_max=SIZING_ACTIONS_KEPT_MAX + 10)
    assert again.sizing_actions() == kept
    assert [j["job_id"] for j in again.jobs()] == ["a-000001"]
    for i in range(10):  # past the record bound: compacted into one snapshot
        again.record_sizing({"action": "RemoveServers", "node_ids": [f"dram-{i}"],
                             "at_unix_s": 100.0 + i})
    assert again.log_info()["records"] < SIZING_ACTIONS_KEPT_MAX
    expected = again.sizing_actions()
    again.close()
    assert Metadata(path).sizing_actions() == expected
