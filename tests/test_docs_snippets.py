"""Every Python snippet in the docs site's pages runs, or says why it is only shown.

The pages are the ones the site is built from (``SITE_SOURCES`` of ``docs/site_hooks.py``). A
``python`` code fence is picked up by the HTML comment that stands before it (blank lines
between are fine), never by its line number, so the docs can be edited freely:

- ``<!-- snippet: run SESSION -->``: run, in document order with the page's other snippets of
  ``SESSION``, in one fresh interpreter per page and session (so a snippet may use the names an
  earlier one made);
- ``<!-- snippet: show REASON -->``: shown only; ``REASON`` says why (it elides code, it takes
  minutes, ...) and must not be empty;
- ``<!-- snippet: hidden SESSION`` ... ``-->``: code run at that point of ``SESSION`` that the
  reader does not see (define the names a snippet takes as given, check what it did);
- ``<!-- snippet: cleanup SESSION`` ... ``-->``: run at the end of ``SESSION`` even when a
  snippet failed (stop the cluster a hidden block started).

A python fence with no marker fails the first test, so a new snippet is run or explicitly shown.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parent.parent
SESSION_TIMEOUT_S = 600.0
"""Bound on one session's interpreter (the README tour starts two local clusters)."""
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(run|show|hidden|cleanup)\b\s*(.*?)\s*(-->)?\s*$")
FENCE_OPEN = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
RUNNABLE_LANGUAGES = ("python", "py")


def _site_sources() -> tuple[str, ...]:
    """The site's page globs, from the mkdocs hook (loaded by path: docs/ is no package)."""
    spec = importlib.util.spec_from_file_location("site_hooks", CHECKOUT / "docs/site_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SITE_SOURCES


def site_pages() -> list[Path]:
    """Every Markdown page of the docs site, its own pages (docs/site/) included."""
    pages = {path for pattern in _site_sources() for path in CHECKOUT.glob(pattern)
             if path.suffix == ".md"}
    pages.update((CHECKOUT / "docs" / "site").rglob("*.md"))
    return sorted(pages)


@dataclass
class Snippet:
    """One marked code block of a page."""

    page: str
    line: int
    kind: str
    """``run``, ``show``, ``hidden`` or ``cleanup``; ``None``-like ``""`` for an unmarked fence."""
    argument: str
    """The session (run, hidden, cleanup) or the reason (show)."""
    code: str
    language: str = "python"

    @property
    def label(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass
class Session:
    """The snippets of one page and session, in document order."""

    page: str
    name: str
    steps: list[Snippet] = field(default_factory=list)
    cleanups: list[Snippet] = field(default_factory=list)


def parse_page(path: Path) -> list[Snippet]:
    """The code fences of one page with their markers, and the hidden and cleanup blocks."""
    page = path.relative_to(CHECKOUT).as_posix()
    lines = path.read_text().splitlines()
    snippets: list[Snippet] = []
    pending: tuple[str, str, int] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(line)
        if marker:
            kind, argument, closed = marker.group(1), marker.group(2), marker.group(3)
            if kind in ("hidden", "cleanup"):
                body: list[str] = []
                i += 1
                while i < len(lines) and lines[i].strip() != "-->":
                    body.append(lines[i])
                    i += 1
                snippets.append(Snippet(page, i + 1, kind, argument, "\n".join(body)))
            else:
                assert closed, f"{page}:{i + 1}: a {kind} marker is one line ending in -->"
                pending = (kind, argument, i + 1)
            i += 1
            continue
        fence = FENCE_OPEN.match(line)
        if fence:
            indent, ticks, language = fence.group(1), fence.group(2), fence.group(3).lower()
            body = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(ticks):
                body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                i += 1
            kind, argument = (pending[0], pending[1]) if pending else ("", "")
            snippets.append(Snippet(page, i, kind, argument, "\n".join(body), language))
            pending = None
        elif line.strip() and pending is not None:
            raise AssertionError(f"{page}:{pending[2]}: a snippet marker must stand right "
                                 "before a code fence (blank lines between are fine)")
        i += 1
    return snippets


def all_snippets() -> list[Snippet]:
    return [snippet for page in site_pages() for snippet in parse_page(page)]


def sessions() -> list[Session]:
    """The runnable sessions of every page."""
    found: dict[tuple[str, str], Session] = {}
    for snippet in all_snippets():
        if snippet.kind not in ("run", "hidden", "cleanup"):
            continue
        if snippet.kind == "run" and snippet.language not in RUNNABLE_LANGUAGES:
            continue
        session = found.setdefault((snippet.page, snippet.argument),
                                   Session(snippet.page, snippet.argument))
        (session.cleanups if snippet.kind == "cleanup" else session.steps).append(snippet)
    return list(found.values())


# Runs a session: stdin is JSON {"steps": [[label, code]...], "cleanups": [...]}; one namespace.
# A cleanup that fails (it may use a name the failed step never made) prints its traceback but
# does not hide the step's error.
RUNNER = """
import json, sys, traceback
session = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
try:
    for label, code in session["steps"]:
        print(f"--- {label}", flush=True)
        exec(compile(code, label, "exec"), namespace)
finally:
    for label, code in session["cleanups"]:
        try:
            exec(compile(code, label, "exec"), namespace)
        except Exception:
            print(f"cleanup {label} failed:", file=sys.stderr)
            traceback.print_exc()
print("--- all snippets ran", flush=True)
"""


def test_every_python_snippet_is_run_or_says_why_not() -> None:
    unmarked, unexplained, stray = [], [], []
    for snippet in all_snippets():
        if snippet.language not in RUNNABLE_LANGUAGES or snippet.kind in ("hidden", "cleanup"):
            continue
        if snippet.kind == "":
            unmarked.append(snippet.label)
        elif snippet.kind == "show" and not snippet.argument:
            unexplained.append(snippet.label)
        elif snippet.kind == "run" and not snippet.argument:
            stray.append(snippet.label)
    assert unmarked == [], "python snippets need <!-- snippet: run SESSION --> or show REASON"
    assert unexplained == [], "a shown-only snippet says why it is not run"
    assert stray == [], "a run marker names its session"


def test_the_parser_finds_the_tours_snippets() -> None:
    # Guards the tests below against a parser (or a marker syntax) that finds nothing.
    readme = parse_page(CHECKOUT / "README.md")
    run = [s for s in readme if s.kind == "run"]
    assert len(run) >= 4
    assert any("LocalCluster()" in s.code for s in run)
    assert all(not s.code.startswith("```") for s in readme)
    assert any(s.page == "README.md" for session in sessions() for s in session.steps)


@pytest.mark.parametrize("session", sessions(), ids=lambda s: f"{s.page}:{s.name}")
def test_docs_snippets_run(session: Session, tmp_path: Path) -> None:
    """One page's session of snippets runs to its end in a fresh interpreter (in a scratch
    directory: snippets may write files)."""
    payload = {"steps": [[s.label, s.code] for s in session.steps],
               "cleanups": [[s.label, s.code] for s in session.cleanups]}
    result = subprocess.run(
        [sys.executable, "-c", RUNNER], input=json.dumps(payload), capture_output=True,
        text=True, timeout=SESSION_TIMEOUT_S, cwd=tmp_path, check=False,
    )
    ran = [line for line in result.stdout.splitlines() if line.startswith("--- ")]
    assert result.returncode == 0, (
        f"snippet failed after {ran[-1] if ran else 'nothing'}:\n{result.stderr[-6000:]}")
    assert ran[-1] == "--- all snippets ran"
