"""The install smoke test (tests/smoke_install.py) passes in this install too: `make
test-wheels` runs the same script from the wheels in fresh virtualenvs without cargo, so the
wheel's server and client pass exactly what the editable install's pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SMOKE_SCRIPT = Path(__file__).with_name("smoke_install.py")
SMOKE_TIMEOUT_S = 120.0


def test_the_install_smoke_client_round_trip_passes_here() -> None:
    result = subprocess.run(
        [sys.executable, str(SMOKE_SCRIPT), "client"], capture_output=True, text=True,
        timeout=SMOKE_TIMEOUT_S, check=False,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["heavy_modules"] == []
    assert report["value"] == f"hello from {sys.executable}"
    assert Path(report["server_binary"]).name == "pocketflow-server"
