"""The include scan: the project headers a source includes, as `cc -MM` lists them, or None
where reading `#include` lines is not enough."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from pocketflow_gg.includes import IncludeScanner


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def cc_mm(root: Path, source: str, flags: list[str]) -> set[str]:
    out = subprocess.run(["gcc", *flags, "-MM", source], cwd=root, capture_output=True,
                         text=True, check=True, timeout=60).stdout.replace("\\\n", " ")
    return set(out.split(":", 1)[1].split()) - {source}


def test_quoted_and_angled_includes_are_searched_as_the_preprocessor_does(tmp_path) -> None:
    root = write(tmp_path, {
        "src/main.c": '#include <stdio.h>\n#include "local.h"\n  #  include <api.h>\n'
                      "int main(void) { return 0; }\n",
        "src/local.h": "#pragma once\n#include \"sub/deep.h\"\n",
        "src/sub/deep.h": '#include "../local.h"\n#include "sibling.h"\n',
        "src/sub/sibling.h": "",
        "include/api.h": "#include <stddef.h>\n#include <conf.h>\n",
        "include/conf.h": "",
        "unused.h": "",
    })
    flags = ["-Iinclude", "-DX=1"]
    headers = IncludeScanner(root).headers("src/main.c", flags)
    assert headers is not None
    assert set(headers) == cc_mm(root, "src/main.c", flags) == {
        "src/local.h", "src/sub/deep.h", "src/sub/sibling.h", "include/api.h",
        "include/conf.h"}
    assert len(headers) == len(set(headers))


def test_computed_includes(tmp_path) -> None:
    root = write(tmp_path, {
        "a.c": '#include "a.h"\n#include CONFIG\n',
        "a.h": "#if defined(USER_H)\n#include USER_H\n#endif\n",
        "conf.h": "",
        "b.c": "#include OTHER\n",
        "c.c": '#include "a.h"\n#define USER_H "conf.h"\n',
    })
    scanner = IncludeScanner(root)
    # Defined on the command line: followed; guarded by its own test and defined nowhere:
    # skipped (the compiler skips it too).
    assert scanner.headers("a.c", ["-DCONFIG=\"conf.h\""]) == ("a.h", "conf.h")
    # Defined in a header the scan cannot evaluate, or guarded but defined somewhere: give up.
    assert scanner.headers("b.c", []) is None
    assert scanner.headers("c.c", []) is None


@pytest.mark.parametrize("text", ['#if __has_include("x.h")\n#endif\n', "#include_next <x.h>\n"])
def test_what_the_scan_cannot_follow_exactly_gives_up(tmp_path, text: str) -> None:
    root = write(tmp_path, {"a.c": text, "x.h": ""})
    assert IncludeScanner(root).headers("a.c", []) is None


@pytest.mark.parametrize("flags", [["-include", "x.h"], ["-isystem", "inc"], ["-I/usr/include"],
                                   ["-I../elsewhere"]])
def test_options_and_directories_outside_the_project_give_up(tmp_path, flags) -> None:
    root = write(tmp_path, {"a.c": "", "x.h": ""})
    assert IncludeScanner(root).headers("a.c", flags) is None
