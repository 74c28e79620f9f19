"""gg's thunk: a function (an executable named by content, its arguments and environment) and
its content-named inputs and declared outputs, serialized as ``##GGTHUNK##`` + the
``gg.protobuf.Thunk`` message and named by the hash of those bytes.

``values``, ``thunks`` and ``executables`` entries are ``(name, filename)`` pairs, written as
``name`` or ``name=filename`` and serialized sorted by name (entries with equal names keep their
order), as gg's multimaps do, so equal thunks get equal names whatever order they were built in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

from pocketflow_gg.errors import InvalidName, InvalidThunk
from pocketflow_gg.objects import (
    MAGIC,
    check_name,
    content_name,
    is_thunk,
    placeholder,
)
from pocketflow_gg.proto import ThunkMessage

Entry = tuple[str, str]
"""``(content name, filename)``; the filename may be empty."""
ENTRIES_MAX = 100_000
"""Most entries of one kind a thunk may have."""


def _entry_string(entry: Entry) -> str:
    name, filename = entry
    return f"{name}={filename}" if filename else name


def _parse_entry(text: str) -> Entry:
    name, _, filename = text.partition("=")
    return check_name(name), filename


def _sorted_entries(entries: Iterable[Entry | str], *, kind: str) -> tuple[Entry, ...]:
    out: list[Entry] = []
    for entry in entries:
        name, filename = _parse_entry(entry) if isinstance(entry, str) else entry
        check_name(name)
        if kind == "values" and is_thunk(name):
            raise InvalidThunk(f"values entry {name} names a thunk")
        if kind == "thunks" and not is_thunk(name):
            raise InvalidThunk(f"thunks entry {name} names a value")
        if kind == "executables" and is_thunk(name):
            raise InvalidThunk(f"executables entry {name} names a thunk")
        out.append((name, filename))
        if len(out) > ENTRIES_MAX:
            raise InvalidThunk(f"more than {ENTRIES_MAX} {kind} entries")
    return tuple(sorted(out, key=lambda entry: entry[0]))


@dataclass(frozen=True)
class Thunk:
    """One gg thunk. Construct with keyword arguments; entries are sorted on construction.

    ``function_hash`` names the executable that runs (one of ``executables``); ``args[0]`` is its
    ``argv[0]``. gg's rules hold: at least one argument, one executable and one output.
    """

    function_hash: str
    args: tuple[str, ...]
    envars: tuple[str, ...] = ()
    values: tuple[Entry, ...] = ()
    thunks: tuple[Entry, ...] = ()
    executables: tuple[Entry, ...] = ()
    outputs: tuple[str, ...] = ()
    timeout_ms: int = 0
    links: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        check_name(self.function_hash)
        set_ = object.__setattr__
        set_(self, "args", tuple(self.args))
        set_(self, "envars", tuple(self.envars))
        set_(self, "outputs", tuple(self.outputs))
        set_(self, "links", tuple(sorted(dict(self.links).items())))
        for kind in ("values", "thunks", "executables"):
            set_(self, kind, _sorted_entries(getattr(self, kind), kind=kind))
        if not self.args:
            raise InvalidThunk("a thunk needs at least one argument (argv0)")
        if not self.executables:
            raise InvalidThunk("a thunk needs at least one executable")
        if not self.outputs:
            raise InvalidThunk("a thunk needs at least one output")
        if len(set(self.outputs)) != len(self.outputs):
            raise InvalidThunk(f"duplicate outputs {self.outputs}")
        if not 0 <= self.timeout_ms <= 0xFFFFFFFF:
            raise InvalidThunk(f"timeout_ms out of range: {self.timeout_ms}")
        for text in (*self.args, *self.envars, *self.outputs):
            if not isinstance(text, str):
                raise InvalidThunk(f"arguments, envars and outputs are strings, got {text!r}")

    # -- serialization -------------------------------------------------------------------------

    def to_message(self) -> ThunkMessage:
        """The ``gg.protobuf.Thunk`` message."""
        message = ThunkMessage()
        message.function.hash = self.function_hash
        message.function.args.extend(self.args)
        message.function.envars.extend(self.envars)
        message.values.extend(_entry_string(e) for e in self.values)
        message.thunks.extend(_entry_string(e) for e in self.thunks)
        message.executables.extend(_entry_string(e) for e in self.executables)
        message.outputs.extend(self.outputs)
        message.timeout = self.timeout_ms
        for key, value in self.links:
            message.links[key] = value
        return message

    @cached_property
    def data(self) -> bytes:
        """The thunk file: ``##GGTHUNK##`` + the serialized message."""
        return MAGIC + self.to_message().SerializeToString(deterministic=True)

    @cached_property
    def name(self) -> str:
        """The thunk's content name (``T...``)."""
        return content_name(self.data)

    @classmethod
    def from_message(cls, message: ThunkMessage) -> Thunk:
        """The thunk of a ``gg.protobuf.Thunk`` message."""
        return cls(
            function_hash=message.function.hash,
            args=tuple(message.function.args),
            envars=tuple(message.function.envars),
            values=tuple(_parse_entry(s) for s in message.values),
            thunks=tuple(_parse_entry(s) for s in message.thunks),
            executables=tuple(_parse_entry(s) for s in message.executables),
            outputs=tuple(message.outputs),
            timeout_ms=message.timeout,
            links=tuple(message.links.items()),
        )

    @classmethod
    def parse(cls, data: bytes | bytearray | memoryview) -> Thunk:
        """Read a thunk file; raises :class:`InvalidThunk` on anything else."""
        raw = bytes(data)
        if not raw.startswith(MAGIC):
            raise InvalidThunk("not a thunk file (no ##GGTHUNK## magic)")
        message = ThunkMessage()
        try:
            message.ParseFromString(raw[len(MAGIC):])
        except Exception as exc:  # protobuf's DecodeError and friends
            raise InvalidThunk(f"cannot parse the thunk message: {exc}") from exc
        try:
            return cls.from_message(message)
        except InvalidName as exc:
            raise InvalidThunk(str(exc)) from exc

    # -- graph ---------------------------------------------------------------------------------

    def dependencies(self) -> list[str]:
        """The thunk names (``T...`` or ``T...#tag``) this thunk needs reduced first."""
        return list(dict.fromkeys(name for name, _ in self.thunks))

    def output_names(self) -> list[str]:
        """How this thunk's outputs are referred to by others: its own name for the first,
        ``name#tag`` for the rest."""
        return [self.name, *(f"{self.name}#{tag}" for tag in self.outputs[1:])]

    def reduced(self, reductions: Mapping[str, str]) -> Thunk:
        """gg's ``force_thunk`` step: the thunk with every ``thunks`` entry found in
        ``reductions`` (thunk reference -> what it reduced to) replaced by its result, in the
        entries (a value moves to ``values``) and in the placeholders of args and envars. The
        result has a new name whenever anything was replaced."""
        if not any(name in reductions for name, _ in self.thunks):
            return self
        values = list(self.values)
        thunks: list[Entry] = []
        for name, filename in self.thunks:
            new = reductions.get(name)
            if new is None:
                thunks.append((name, filename))
            elif is_thunk(new):
                thunks.append((new, filename))
            else:
                values.append((new, filename))

        def rewrite(text: str) -> str:
            for old, new in reductions.items():
                text = text.replace(placeholder(old), placeholder(new))
            return text

        return replace(
            self,
            args=tuple(rewrite(a) for a in self.args),
            envars=tuple(rewrite(e) for e in self.envars),
            values=tuple(values),
            thunks=tuple(thunks),
        )
