"""The adapter's tests run in the project's pytest session with the shared fixtures of
``tests/`` (one Ray and one local cluster per session)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

pytest_plugins = ["fixtures_servers", "fixtures_cluster", "fixtures_s3"]
