"""Immutable value classes for the client's path without ``dataclasses`` or ``typing``.

Every task process (each Lithops function is a new one) imports the client, and defining a
frozen dataclass costs it ``dataclasses`` (which imports ``inspect``, ``ast``, ``dis`` and
``tokenize``) plus about 1.5 ms per class; a ``typing.NamedTuple`` costs it ``typing``. Together
they were a third of a fresh ``import pocketflow`` + ``connect`` (benchmarks/import_connect.py).

:class:`Record` gives a class with ``__slots__`` and its own ``__init__`` what a frozen dataclass
gave it: assignment raises, equality and hashing over its fields, a ``repr`` naming them,
:meth:`Record.replace` (as ``dataclasses.replace``) and pickling through ``__init__``.
:class:`NamedTuple` is ``typing.NamedTuple`` for type checkers and a plain
``collections.namedtuple`` (with the class body's methods) at run time.
"""

from __future__ import annotations

from collections import namedtuple

TYPE_CHECKING = False
"""``typing.TYPE_CHECKING`` without importing ``typing`` (type checkers treat the name alike)."""

if TYPE_CHECKING:
    from typing import Any, NamedTuple, Self

__all__ = ["Record", "NamedTuple"]


class Record:
    """Base of an immutable value class: the subclass names its fields in ``__slots__`` (in
    constructor order) and sets them in ``__init__`` with :meth:`_set`.

    ``_UNCOMPARED`` names fields left out of equality and hashing (shown by ``repr``, kept by
    :meth:`replace` and pickling)."""

    __slots__ = ()
    _UNCOMPARED: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Without its own __slots__ a subclass would have no fields to compare, show or copy.
        if "__slots__" not in cls.__dict__ or not cls.__slots__:
            raise TypeError(f"{cls.__name__} must name its fields in __slots__")

    @classmethod
    def _fields(cls) -> tuple[str, ...]:
        """The fields in constructor order (the class's ``__slots__``)."""
        return cls.__slots__

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._fields())

    def _compared(self) -> tuple[Any, ...]:
        if not self._UNCOMPARED:
            return self._values()
        return tuple(getattr(self, n) for n in self._fields() if n not in self._UNCOMPARED)

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` applied, built (and so checked) by ``__init__``."""
        values = {name: getattr(self, name) for name in self._fields()}
        unknown = set(changes) - values.keys()
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field(s) {sorted(unknown)}")
        values.update(changes)
        return type(self)(**values)

    def _set(self, **values: Any) -> None:
        """Set fields from ``__init__``: the one way past the frozen ``__setattr__``."""
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"cannot assign to field {name!r} of a frozen {type(self).__name__}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r} of a frozen {type(self).__name__}")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._compared() == other._compared()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._compared())

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields())
        return f"{type(self).__qualname__}({shown})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Through __init__ (positional, in field order), so an unpickled value is checked as a
        # new one is; copy.copy and copy.deepcopy use this too.
        return (type(self), self._values())


if not TYPE_CHECKING:
    _NOT_COPIED = frozenset(("__module__", "__qualname__", "__annotations__", "__classcell__"))

    class _NamedTupleMeta(type):
        """Builds a ``collections.namedtuple`` from a class body's annotations and defaults,
        then copies the body's other attributes (methods, properties, docstring) onto it."""

        def __new__(mcls, name: str, bases: tuple, namespace: dict) -> type:
            if not bases:
                return super().__new__(mcls, name, bases, namespace)
            fields = list(namespace.get("__annotations__", {}))
            defaults = [namespace[f] for f in fields if f in namespace]
            if any(f not in namespace for f in fields[len(fields) - len(defaults):]):
                raise TypeError(f"{name}: a field without a default follows one with a default")
            cls = namedtuple(name, fields, defaults=defaults, module=namespace["__module__"])
            for key, value in namespace.items():
                if key not in fields and key not in _NOT_COPIED:
                    setattr(cls, key, value)
            cls.__qualname__ = namespace.get("__qualname__", name)
            return cls

    class NamedTuple(metaclass=_NamedTupleMeta):
        """Subclass as ``typing.NamedTuple``; the class made is a plain named tuple."""
