"""Shared pytest fixtures: storage server processes (no Ray) and the embedded local cluster."""

pytest_plugins = ["fixtures_servers", "fixtures_cluster", "fixtures_s3"]
