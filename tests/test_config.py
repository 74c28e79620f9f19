"""Sizes and durations parsed once; keyword > environment > config file > default."""

import json
from pathlib import Path

import pytest

from pocketflow.config import (
    ClientConfig,
    config_file_path,
    load_file_table,
    parse_bool,
    parse_duration,
    parse_size,
)
from pocketflow.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1048576, 1048576),
        ("4096", 4096),
        ("64MiB", 64 * 1024**2),
        ("1 GB", 10**9),
        ("1GiB", 1024**3),
        ("1.5KiB", 1536),
        ("10 kb", 10_000),
        ("3b", 3),
        (" 2 TiB ", 2 * 1024**4),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "MiB", "-1", "1.5", "12 parsecs", "1e3", True, None, [1]])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_size(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [(30, 30.0), ("30s", 30.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0),
     ("250us", 0.00025), ("1.5", 1.5), ("2min", 120.0)],
)
def test_parse_duration(text: object, expected: float) -> None:
    assert parse_duration(text) == pytest.approx(expected)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "s", "-1s", "5 fortnights", False, "inf"])
def test_parse_duration_rejects(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_duration(bad)  # type: ignore[arg-type]


def test_parse_bool() -> None:
    assert parse_bool("yes") and parse_bool(1) and parse_bool(True)
    assert not parse_bool("off") and not parse_bool(0)
    with pytest.raises(ConfigError):
        parse_bool("maybe")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_resolution_order(tmp_path: Path) -> None:
    config = _write(tmp_path / "config.toml", """
[client]
block_size_bytes = "4MiB"
exchange_window = 32
op_timeout_s = "2s"
io_threads = 3
""")
    env = {"POCKETFLOW_CONFIG": str(config), "POCKETFLOW_EXCHANGE_WINDOW": "16",
           "POCKETFLOW_OP_TIMEOUT_S": "750ms"}
    resolved = ClientConfig.resolve(env, op_timeout_s="5s")
    assert resolved.op_timeout_s == 5.0  # keyword beats environment
    assert resolved.exchange_window == 16  # environment beats file
    assert resolved.block_size_bytes == 4 * 1024**2  # file beats default
    assert resolved.io_threads == 3
    assert resolved.rpc_timeout_s == ClientConfig().rpc_timeout_s  # default
    assert {"op_timeout_s", "exchange_window", "block_size_bytes", "io_threads"} <= set(
        resolved.explicit
    )
    assert "rpc_timeout_s" not in resolved.explicit


def test_defaults_without_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    resolved = ClientConfig.resolve({})
    assert resolved == ClientConfig()
    assert resolved.exchange_window == 64
    assert resolved.explicit == frozenset()
    assert config_file_path({}) is None


def test_bad_values_and_names(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown client option"):
        ClientConfig.resolve({}, exchange_windw=3)
    with pytest.raises(ConfigError):
        ClientConfig.resolve({}, exchange_window=0)
    with pytest.raises(ConfigError):
        ClientConfig.resolve({}, exchange_window=257)
    with pytest.raises(ConfigError):
        ClientConfig.resolve({}, block_size_bytes="17MiB")
    with pytest.raises(ConfigError, match="POCKETFLOW_SMALL_OPS"):
        ClientConfig.resolve({"POCKETFLOW_SMALL_OPS": "udp"})
    assert ClientConfig.resolve({}).small_ops == "direct"
    assert ClientConfig.resolve({"POCKETFLOW_SMALL_OPS": "flight"}).small_ops == "flight"
    with pytest.raises(ConfigError):
        ClientConfig.resolve({"POCKETFLOW_IO_THREADS": "many"})
    # The core moves one object's blocks on at most 64 threads: more is refused, not capped.
    assert ClientConfig.resolve({}, io_threads=64).io_threads == 64
    with pytest.raises(ConfigError, match="io_threads"):
        ClientConfig.resolve({}, io_threads=65)
    with pytest.raises(ConfigError, match="is not a file"):
        ClientConfig.resolve({"POCKETFLOW_CONFIG": str(tmp_path / "absent.toml")})
    broken = _write(tmp_path / "broken.toml", "[client\n")
    with pytest.raises(ConfigError, match="cannot read"):
        ClientConfig.resolve({"POCKETFLOW_CONFIG": str(broken)})
    stray = _write(tmp_path / "stray.toml", "[client]\nwindow = 3\n")
    with pytest.raises(ConfigError, match="unknown key"):
        ClientConfig.resolve({"POCKETFLOW_CONFIG": str(stray)})


def test_other_tables_are_left_to_their_owners(tmp_path: Path) -> None:
    config = _write(tmp_path / "c.toml", "[cluster]\nservers = 3\n[client]\nio_threads = 2\n")
    env = {"POCKETFLOW_CONFIG": str(config)}
    assert load_file_table("cluster", env) == {"servers": 3}
    assert ClientConfig.resolve(env).io_threads == 2


UNITS_VECTORS = Path(__file__).parent / "vectors" / "units.json"
"""The size and duration cases the client core's (and the server's) grammar passes too."""


def test_every_shared_size_and_duration_case_parses_as_the_rust_side_does() -> None:
    cases = json.loads(UNITS_VECTORS.read_text())
    assert len(cases["sizes"]) >= 20 and len(cases["durations"]) >= 20
    for text, expected in cases["sizes"]:
        if expected is None:
            with pytest.raises(ConfigError, match="hint_x: "):
                parse_size(text, name="hint_x")
        else:
            assert parse_size(text) == expected, text
    for text, expected in cases["durations"]:
        if expected is None:
            with pytest.raises(ConfigError, match="flag_y: "):
                parse_duration(text, name="flag_y")
        else:
            assert parse_duration(text) == expected / 1e9, text
