"""Client configuration: sizes and durations parsed once, from keywords, environment, then a file.

Resolution order, first match wins, for every setting of :class:`ClientConfig`:

1. keyword arguments (``pocketflow.connect(handle, exchange_window=128)``);
2. environment variables ``POCKETFLOW_<NAME>`` with the setting's name upper-cased
   (``POCKETFLOW_BLOCK_SIZE_BYTES=4MiB``, ``POCKETFLOW_OP_TIMEOUT_S=5s``);
3. the ``[client]`` table of a TOML config file: the path in ``POCKETFLOW_CONFIG`` if set, else
   ``~/.config/pocketflow/config.toml`` if it exists;
4. the defaults below.

Sizes accept an integer number of bytes or a string with a unit: ``"64MiB"``, ``"1 GB"``,
``"4096"`` (``KB``/``MB``/``GB``/``TB`` are powers of 1000, ``KiB``/``MiB``/``GiB``/``TiB`` powers
of 1024). Durations accept a number of seconds or a string: ``"30s"``, ``"500ms"``, ``"2m"``,
``"250us"``, ``"1h"``. Anything else raises :class:`~pocketflow.errors.ConfigError`.

=========================  ==========  ==========================================================
setting                    default     meaning
=========================  ==========  ==========================================================
``block_size_bytes``       ``1MiB``    data block size of large objects written by this client;
                                       unset, the job handle's block size is used
``exchange_window``        ``64``      operations in flight per DoExchange session (1-256)
``io_threads``             ``8``       threads moving data blocks to and from servers in parallel
``sessions_per_server``    ``8``       most DoExchange sessions a client keeps open per server
``connect_timeout_s``      ``5s``      how long a new session waits for its first reply (the
                                       connection and the token check); at most ``op_timeout_s``
``op_timeout_s``           ``3s``      how long any call may wait without progress (the reply of
                                       a small operation, the next piece of a DoGet) before the
                                       server is given up with ``DataUnavailable``; a transfer
                                       that keeps moving is never cut by it. The default matches
                                       the control plane's ``dead_after`` (3 s), so a read from a
                                       hung server fails within the failure bound
``rpc_timeout_s``          ``30s``     deadline of one action (enumerate, buckets, delete_prefix,
                                       ...; get, lookup and delete use ``op_timeout_s``), and how
                                       long a call waits for a free session of its server
``stream_timeout_s``       ``300s``    longest deadline of one DoPut or DoGet stream; a stream
                                       gets the longer of ``op_timeout_s`` and ``rpc_timeout_s``
                                       plus 1 s per 8 MiB it moves, up to this
``small_ops``              ``direct``  how small operations and data blocks travel: ``direct``
                                       (plain TCP on the server's port, written and read on the
                                       calling thread) or ``flight`` (DoExchange sessions, DoPut
                                       and DoGet over HTTP/2); see docs/PROTOCOL.md
=========================  ==========  ==========================================================

Other components read their own table of the same file with :func:`load_file_table`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping

from pocketflow import _core
from pocketflow.errors import ConfigError
from pocketflow.protocol import BLOCK_SIZE_DEFAULT_BYTES, BLOCK_SIZE_MAX_BYTES, SESSION_INFLIGHT_MAX
from pocketflow.records import TYPE_CHECKING, Record

if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

__all__ = [
    "ENV_PREFIX",
    "CONFIG_PATH_ENV",
    "DEFAULT_CONFIG_PATH",
    "ClientConfig",
    "parse_size",
    "parse_duration",
    "parse_bool",
    "config_file_path",
    "load_file_table",
]

ENV_PREFIX = "POCKETFLOW_"
CONFIG_PATH_ENV = "POCKETFLOW_CONFIG"
DEFAULT_CONFIG_PATH = "~/.config/pocketflow/config.toml"
"""The config file read when ``$POCKETFLOW_CONFIG`` is unset (``~`` is expanded at use)."""
BLOCK_SIZE_MIN_BYTES = 4096
IO_THREADS_MAX = 64
"""Most threads one object's data blocks move on (the client core's ``IO_THREADS_MAX``)."""
SESSIONS_PER_SERVER_MAX = 64

_NANOS_PER_SECOND = 1_000_000_000


def parse_size(value: int | float | str, *, name: str = "size") -> int:
    """Parse a size in bytes: ``1048576``, ``"64MiB"``, ``"1.5 GB"``; returns whole bytes.

    A string follows the one grammar of the client core and the server's flags
    (``pocketflow_protocol::units``: a non-negative decimal number and an optional unit, B, kB,
    MB, GB, TB, KiB, MiB, GiB or TiB, case-insensitive; exact, whole bytes, at most 64 bits); the
    cases of ``tests/vectors/units.json`` hold for both."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, str):
        try:
            return int(_core.parse_size(value))
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    if not isinstance(value, (int, float)):
        raise ConfigError(f"{name}: expected a size, got {type(value).__name__}")
    if value < 0 or not math.isfinite(value):
        raise ConfigError(f"{name}: size must be a finite non-negative number, got {value!r}")
    if value != int(value):
        raise ConfigError(f"{name}: {value!r} is not a whole number of bytes")
    return int(value)


def parse_duration(value: int | float | str, *, name: str = "duration") -> float:
    """Parse a duration in seconds: ``30``, ``"30s"``, ``"500ms"``, ``"2m"``; returns seconds.

    A string follows the one grammar of the client core and the server's flags (a non-negative
    decimal number and an optional unit, us, ms, s, m or min, h; no unit is seconds; whole
    nanoseconds), as :func:`parse_size` says."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a duration, got {value!r}")
    if isinstance(value, str):
        try:
            return int(_core.parse_duration_ns(value)) / _NANOS_PER_SECOND
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    if not isinstance(value, (int, float)):
        raise ConfigError(f"{name}: expected a duration, got {type(value).__name__}")
    seconds = float(value)
    if seconds < 0 or not math.isfinite(seconds):
        raise ConfigError(f"{name}: duration must be finite and non-negative, got {value!r}")
    return seconds


def parse_bool(value: bool | int | str, *, name: str = "flag") -> bool:
    """Parse a boolean: ``True``, ``1``, ``"true"``, ``"yes"``, ``"on"`` (and their opposites)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
    raise ConfigError(f"{name}: cannot parse boolean {value!r}")


def _parse_count(value: int | str, *, name: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("+").isdigit():
        return int(value.strip())
    raise ConfigError(f"{name}: expected an integer, got {value!r}")


def config_file_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """The config file in effect: ``$POCKETFLOW_CONFIG``, else the default path if it exists."""
    env = os.environ if environ is None else environ
    explicit = env.get(CONFIG_PATH_ENV)
    path = os.path.expanduser(explicit or DEFAULT_CONFIG_PATH)
    if not os.path.isfile(path):
        if explicit:
            raise ConfigError(f"{CONFIG_PATH_ENV}={explicit} is not a file")
        return None
    # Imported only when there is a file: every process that connects resolves its settings,
    # and most (each Lithops task) have no config file to pay pathlib's import for.
    from pathlib import Path

    return Path(path)


def load_file_table(table: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Read one table (``[client]``, ``[cluster]``, ...) of the config file; ``{}`` if absent."""
    path = config_file_path(environ)
    if path is None:
        return {}
    # Imported here: tomllib compiles its regular expressions on import (some 4 ms), which every
    # process that connects without a config file (each Lithops task) would pay for nothing.
    import tomllib

    try:
        with path.open("rb") as f:
            document = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    section = document.get(table, {})
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: [{table}] must be a table")
    return section


SMALL_OPS_TRANSPORTS = ("direct", "flight")


def _validate_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(choices)}")
    return str(value)


def _validate_range(name: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise ConfigError(f"{name}: {value} is outside {low}..{high}")
    return value


_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "block_size_bytes": lambda v, n: _validate_range(
        n, parse_size(v, name=n), BLOCK_SIZE_MIN_BYTES, BLOCK_SIZE_MAX_BYTES
    ),
    "exchange_window": lambda v, n: _validate_range(
        n, _parse_count(v, name=n), 1, SESSION_INFLIGHT_MAX
    ),
    "io_threads": lambda v, n: _validate_range(n, _parse_count(v, name=n), 1, IO_THREADS_MAX),
    "sessions_per_server": lambda v, n: _validate_range(
        n, _parse_count(v, name=n), 1, SESSIONS_PER_SERVER_MAX
    ),
    "connect_timeout_s": lambda v, n: parse_duration(v, name=n),
    "op_timeout_s": lambda v, n: parse_duration(v, name=n),
    "rpc_timeout_s": lambda v, n: parse_duration(v, name=n),
    "stream_timeout_s": lambda v, n: parse_duration(v, name=n),
    "small_ops": lambda v, n: _validate_choice(n, v, SMALL_OPS_TRANSPORTS),
}


class ClientConfig(Record):
    """Resolved client settings; build with :meth:`ClientConfig.resolve` (immutable;
    :meth:`replace` makes a changed copy).

    ``explicit`` names the settings that came from a keyword, the environment or the file rather
    than from the defaults (the client uses the job handle's block size unless one was given); it
    is left out of equality and hashing.
    """

    __slots__ = ("block_size_bytes", "exchange_window", "io_threads", "sessions_per_server",
                 "connect_timeout_s", "op_timeout_s", "rpc_timeout_s", "stream_timeout_s",
                 "small_ops", "explicit")
    _UNCOMPARED = ("explicit",)
    block_size_bytes: int
    exchange_window: int
    io_threads: int
    sessions_per_server: int
    connect_timeout_s: float
    op_timeout_s: float
    rpc_timeout_s: float
    stream_timeout_s: float
    small_ops: str
    explicit: frozenset[str]

    def __init__(
        self,
        block_size_bytes: int = BLOCK_SIZE_DEFAULT_BYTES,
        exchange_window: int = 64,
        io_threads: int = 8,
        sessions_per_server: int = 8,
        connect_timeout_s: float = 5.0,
        op_timeout_s: float = 3.0,
        rpc_timeout_s: float = 30.0,
        stream_timeout_s: float = 300.0,
        small_ops: str = "direct",
        explicit: frozenset[str] = frozenset(),
    ) -> None:
        self._set(
            block_size_bytes=block_size_bytes,
            exchange_window=exchange_window,
            io_threads=io_threads,
            sessions_per_server=sessions_per_server,
            connect_timeout_s=connect_timeout_s,
            op_timeout_s=op_timeout_s,
            rpc_timeout_s=rpc_timeout_s,
            stream_timeout_s=stream_timeout_s,
            small_ops=small_ops,
            explicit=explicit,
        )

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """Names of every setting, as accepted by :meth:`resolve`."""
        return tuple(name for name in cls._fields() if name != "explicit")

    @classmethod
    def resolve(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> ClientConfig:
        """Resolve every setting: keywords, then ``POCKETFLOW_*`` variables, then the file."""
        env = os.environ if environ is None else environ
        names = cls.setting_names()
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ConfigError(
                f"unknown client option(s) {', '.join(unknown)}; known: {', '.join(names)}"
            )
        file_table: dict[str, Any] | None = None
        values: dict[str, Any] = {}
        explicit: set[str] = set()
        for name in names:
            source: str
            if overrides.get(name) is not None:
                raw, source = overrides[name], name
            elif (ENV_PREFIX + name.upper()) in env:
                raw, source = env[ENV_PREFIX + name.upper()], ENV_PREFIX + name.upper()
            else:
                if file_table is None:
                    file_table = load_file_table("client", env)
                if name not in file_table:
                    continue
                raw, source = file_table[name], f"[client] {name}"
            values[name] = _PARSERS[name](raw, source)
            explicit.add(name)
        if file_table:
            stray = sorted(set(file_table) - set(names))
            if stray:
                raise ConfigError(f"unknown key(s) in [client] of the config file: {stray}")
        return cls(**values, explicit=frozenset(explicit))
