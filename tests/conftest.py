"""Shared pytest fixtures: storage server processes (no Ray) and the embedded local cluster."""

pytest_plugins = ["fixtures_servers", "fixtures_cluster", "fixtures_s3"]


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    """The suite leaves no slot of the cache's shared-memory read pool in ``/dev/shm`` (only
    the controller of a parallel run removes them, once every worker has ended)."""
    if hasattr(getattr(session, "config", None), "workerinput"):
        return
    from pocketflow.cache.client import free_arena_pool

    free_arena_pool()
