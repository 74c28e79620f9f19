"""The adapter's errors: one base class, one subclass per thing a caller can handle."""

from __future__ import annotations


class GGError(Exception):
    """Base class of pocketflow_gg's errors."""


class InvalidName(GGError, ValueError):
    """A string is not a gg content name (``V``/``T``, 43 base64 characters, 8 hex digits)."""


class InvalidThunk(GGError, ValueError):
    """Bytes are not a thunk file, or a thunk breaks gg's rules (no output, no executable...)."""


class InferError(GGError):
    """A build step could not be turned into a thunk (unknown tool, unsupported flag...)."""


class ThunkFailed(GGError):
    """A thunk's function exited with an error, or a declared output was not produced."""

    def __init__(self, thunk_hash: str, message: str) -> None:
        super().__init__(f"thunk {thunk_hash}: {message}")
        self.thunk_hash = thunk_hash


class MissingObject(GGError):
    """An object a thunk needs is in neither the store nor the reductions."""
