"""Tests of the Metadata actor's logic (as a plain object) and of the controller's job names."""

from __future__ import annotations

from pathlib import Path

import pytest

from pocketflow.control.controller import validate_job_name
from pocketflow.control.metadata import Metadata
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


def test_controller_bounds_its_metadata_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung Metadata actor must surface as a ClusterError, not hang the controller."""
    import ray
    from ray.exceptions import GetTimeoutError

    from pocketflow.auth import write_secret_file
    from pocketflow.control.controller import Controller
    from pocketflow.errors import ClusterError

    secret_file = tmp_path / "secret"
    write_secret_file(secret_file)

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
    controller = Controller(secret_file=str(secret_file), metadata=HungMetadata(),
                            block_size_bytes=1 << 20)
    with pytest.raises(ClusterError):
        controller._call_metadata("put_job", {"job_id": "x"})
