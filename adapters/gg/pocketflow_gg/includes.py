"""The project headers a C source includes, found by reading ``#include`` lines (what ``cc -MM``
prints, without running the preprocessor), or ``None`` where reading them is not enough.

The scan follows every ``#include "..."`` and ``#include <...>`` it finds, whatever ``#if`` it
sits under, so it may list a header the compiler skips (a superset: the thunk carries one value
too many, never one too few). A header is searched as the preprocessor does (the including
file's directory for quotes, then each ``-I`` directory in order); one that is not in the
project is a system header, which workers have (as they have libc). A computed include
(``#include NAME``) is followed when ``NAME`` is defined on the command line, and skipped when it
sits directly under a test of its own definition (``#if defined(NAME)``, ``#ifdef NAME``) that
nothing scanned defines; anything else the scan cannot follow exactly (``__has_include``,
``#include_next``, another computed include, options such as ``-include`` or ``-isystem``)
makes it give up, and the caller asks the compiler (``cc -MM``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

INCLUDE_DEPTH_MAX = 200
"""Most nested includes one scan follows (the preprocessor's own limit is 200)."""
HEADERS_MAX = 10_000
"""Most headers one source may include."""
_DIRECTIVE = re.compile(rb"^[ \t]*#[ \t]*(\w+)[ \t]*(.*?)[ \t]*$", re.MULTILINE)
_GUARD = re.compile(rb"^(?:ifdef[ \t]+(\w+)|if[ \t]+defined[ \t]*\(?[ \t]*(\w+)[ \t]*\)?)$")
_NAME = re.compile(rb"^\w+$")
_UNSCANNABLE_OPTIONS = ("-include", "-imacros", "-isystem", "-idirafter", "-iquote", "-iprefix",
                        "-iwithprefix", "-nostdinc", "-I-", "--include")


@dataclass(frozen=True)
class _Include:
    operand: bytes  # what follows the directive: "x.h", <x.h> or a macro name
    guard: bytes | None  # the macro tested by the directive just before it, if any


@dataclass
class IncludeScanner:
    """Scans the sources of one project, reading each file once."""

    project: Path
    _includes: dict[str, tuple[list[_Include], set[bytes], bool]] = field(default_factory=dict)
    _resolved: dict[tuple[bytes, str, tuple[str, ...]], str | None] = field(
        default_factory=dict)

    def headers(self, source: str, flags: list[str]) -> tuple[str, ...] | None:
        """The project headers ``source`` (relative to the project) may include under the
        compile ``flags``, relative to the project, in the order found; ``None`` when the scan
        cannot tell exactly enough."""
        dirs: list[str] = []
        defined: dict[bytes, bytes] = {}
        words = iter(flags)
        for word in words:
            if word.startswith(_UNSCANNABLE_OPTIONS):
                return None
            if word in ("-I", "-D", "-U"):
                word += next(words, "")
            if word.startswith("-I"):
                directory = os.path.normpath(word[2:])
                if not _inside(directory):
                    return None
                dirs.append(directory)
            elif word.startswith("-D"):
                name, _, value = word[2:].partition("=")
                defined[name.encode()] = (value or "1").encode()
            elif word.startswith("-U"):
                defined.pop(word[2:].encode(), None)
        found: list[str] = []
        seen: set[str] = set()
        guarded: set[bytes] = set()  # computed includes skipped: nothing may define them
        defines: set[bytes] = set()
        stack = [(os.path.normpath(source), 0)]
        while stack:  # depth first, in the order the preprocessor meets them
            current, depth = stack.pop()
            if current in seen:
                continue
            if depth > INCLUDE_DEPTH_MAX or len(found) >= HEADERS_MAX:
                return None
            seen.add(current)
            if depth:
                found.append(current)
            parsed = self._parse(current)
            if parsed is None:
                return None
            includes, file_defines, exact = parsed
            if not exact:
                return None
            defines |= file_defines
            for include in reversed(includes):
                operand = include.operand
                if _NAME.match(operand):
                    if operand in defined:
                        operand = defined[operand]
                    elif include.guard == operand:
                        guarded.add(operand)
                        continue
                    else:
                        return None
                key = (operand, os.path.dirname(current), tuple(dirs))
                if key not in self._resolved:
                    self._resolved[key] = self._resolve(*key)
                header = self._resolved[key]
                if header is None or header in seen:
                    continue
                if not _inside(header):
                    return None
                stack.append((header, depth + 1))
        if guarded & defines:
            return None
        return tuple(found)

    def _parse(self, relative: str) -> tuple[list[_Include], set[bytes], bool] | None:
        known = self._includes.get(relative)
        if known is not None:
            return known
        try:
            text = (self.project / relative).read_bytes()
        except OSError:
            return None
        includes: list[_Include] = []
        defines: set[bytes] = set()
        exact = b"__has_include" not in text
        previous: bytes | None = None
        for match in _DIRECTIVE.finditer(text):
            directive, rest = match.group(1), match.group(2)
            if directive == b"include":
                guard = _GUARD.match(previous) if previous is not None else None
                includes.append(_Include(rest.split(b"//", 1)[0].split(b"/*", 1)[0].strip(),
                                         (guard.group(1) or guard.group(2)) if guard else None))
            elif directive in (b"include_next", b"import"):
                exact = False
            elif directive == b"define":
                defines.add(re.split(rb"[\s(]", rest, maxsplit=1)[0])
            previous = directive + b" " + rest
        parsed = (includes, defines, exact)
        self._includes[relative] = parsed
        return parsed

    def _resolve(self, operand: bytes, here: str, dirs: tuple[str, ...]) -> str | None:
        """The project file an include operand names (relative to the project), or None for a
        system header."""
        if len(operand) < 2:
            return None
        quote, name = operand[:1] + operand[-1:], operand[1:-1].decode(errors="replace")
        if quote == b'""':
            candidates = [here, *dirs]
        elif quote == b"<>":
            candidates = dirs
        else:
            return None
        if os.path.isabs(name):
            return os.path.normpath(name)  # outside the project: the caller gives up
        for directory in candidates:
            relative = os.path.normpath(os.path.join(directory, name))
            if (self.project / relative).is_file():
                return relative
        return None


def _inside(relative: str) -> bool:
    return not os.path.isabs(relative) and relative != ".." and not relative.startswith("../")
