"""Infer: turn a make build into a graph of gg thunks, the way gg's model programs do.

``make -n -B TARGET`` prints every command the build runs. Each compile (``cc -c``), archive
(``ar``), ``ranlib`` and link step becomes a thunk; file bookkeeping (``touch``, ``echo``, ``rm``,
``mkdir``) is skipped; anything else is an :class:`InferError`. A compile thunk carries its
source and the project headers it includes (the list ``cc -MM`` prints, found by reading
``#include`` lines, see :mod:`pocketflow_gg.includes`) as values at their paths and runs make's
own command, so it costs what make's compile costs. With ``preprocess`` (gg's own model), or
where the headers cannot be listed that way, the source is preprocessed here, on the driver
(``cc -E``, with ``-MMD`` for its list of headers), and its thunk compiles the ``.i`` value, so
workers need no headers at all. A step's input produced by
an earlier step is that step's thunk (an entry of ``thunks``); one that is a file of the project
is a value. The compiler driver, ``cc1``, ``as``, ``collect2``, ``ld``, ``ar`` and ``ranlib``
are executables of the thunks, named by content; each thunk sets ``GCC_EXEC_PREFIX`` (the host
``gcc`` started from a hash-named path finds its own libraries through it) and passes ``-B
bin/`` so the driver runs the thunk's own ``cc1``, ``as`` and ``collect2``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pocketflow_gg.errors import InferError
from pocketflow_gg.includes import IncludeScanner
from pocketflow_gg.objects import content_name, file_name, size_of
from pocketflow_gg.thunk import Entry, Thunk

MAKE_TIMEOUT_S = 120.0
PREPROCESS_TIMEOUT_S = 120.0
PREPROCESS_THREADS = max(1, os.cpu_count() or 1)
"""Sources preprocessed at once on the driver."""
STEPS_MAX = 100_000
"""Most build steps one inference turns into thunks."""
SKIPPED_COMMANDS = frozenset({"touch", "echo", "rm", "mkdir", "true", ":", "printf"})
_COMPILER = re.compile(r"^(cc|c89|c99|gcc|clang|(\S+-)?gcc(-\d+)?)$")
_AR = re.compile(r"^((\S+-)?ar)$")
_RANLIB = re.compile(r"^((\S+-)?ranlib)$")
_SHELL_SYNTAX = re.compile(r"[;&|<>`$()]")
_SOURCE_SUFFIXES = (".c",)
# Options whose argument is the next word, and which only the preprocessor needs.
_PREPROCESSOR_OPTIONS_WITH_ARG = frozenset({"-I", "-D", "-U", "-include", "-isystem", "-iquote",
                                            "-imacros", "-idirafter"})
_DEPENDENCY_OPTIONS_WITH_ARG = frozenset({"-MF", "-MT", "-MQ"})
_DEPENDENCY_FLAGS = frozenset({"-M", "-MM", "-MD", "-MMD", "-MG", "-MP"})
_PREPROCESSOR_PREFIXES = ("-I", "-D", "-U")


@dataclass(frozen=True)
class Step:
    """One build step of the inferred graph."""

    kind: str  # "compile", "archive", "ranlib" or "link"
    output: str  # the file it produces, relative to the project
    thunk: str  # the thunk's name
    inputs: tuple[str, ...]  # project files and earlier outputs it reads
    headers: tuple[str, ...] = ()  # for a compile: the headers its source includes


@dataclass
class BuildGraph:
    """The thunks of a build and the values they need, ready to be written to a store."""

    source_dir: Path
    thunks: dict[str, Thunk] = field(default_factory=dict)
    values: dict[str, bytes | Path] = field(default_factory=dict)
    """Content name -> its bytes, or the file holding them (sources, executables)."""
    executables: set[str] = field(default_factory=set)
    steps: list[Step] = field(default_factory=list)
    producers: dict[str, str] = field(default_factory=dict)
    """Output file (relative to the project) -> the thunk reference that produces it."""

    def target(self, filename: str) -> str:
        """The thunk reference that produces ``filename``."""
        key = os.path.normpath(filename)
        if key not in self.producers:
            raise InferError(f"no build step produces {filename!r}; "
                             f"known outputs: {sorted(self.producers)[:20]}")
        return self.producers[key]

    def value_bytes(self, name: str) -> bytes:
        """The bytes of value ``name``."""
        source = self.values[name]
        data = source.read_bytes() if isinstance(source, Path) else source
        if content_name(data) != name:
            raise InferError(f"{source} changed since it was read (expected {name})")
        return data

    def total_bytes(self) -> int:
        """Bytes of every value and thunk of the graph."""
        return (sum(size_of(n) for n in self.values)
                + sum(len(t.data) for t in self.thunks.values()))


@dataclass
class Toolchain:
    """The host tools, resolved to files and named by content, each asked and hashed once per
    build (a compile step would otherwise run its driver twice more just to ask where ``cc1``
    and ``as`` are and what its install directory is: about 100 processes for Lua's build)."""

    _names: dict[Path, str] = field(default_factory=dict)
    _progs: dict[tuple[Path, str], Path] = field(default_factory=dict)
    _exec_prefixes: dict[Path, str] = field(default_factory=dict)

    def name_of(self, path: Path) -> str:
        real = path.resolve()
        if real not in self._names:
            self._names[real] = file_name(real)
        return self._names[real]

    @staticmethod
    def which(program: str) -> Path:
        found = shutil.which(program)
        if found is None:
            raise InferError(f"{program!r} is not on PATH")
        return Path(found).resolve()

    def prog(self, driver: Path, name: str) -> Path:
        """What ``driver`` runs for ``name`` (``cc1``, ``as``, ``collect2``, ``ld``)."""
        known = self._progs.get((driver, name))
        if known is not None:
            return known
        out = subprocess.run([str(driver), f"-print-prog-name={name}"], capture_output=True,
                             text=True, timeout=30, check=False).stdout.strip()
        if not out:
            raise InferError(f"{driver} does not know its {name}")
        found = Path(out).resolve() if os.path.isabs(out) else self.which(out)
        self._progs[(driver, name)] = found
        return found

    def exec_prefix(self, driver: Path) -> str:
        """``GCC_EXEC_PREFIX`` for ``driver``: two levels above its install directory."""
        known = self._exec_prefixes.get(driver)
        if known is not None:
            return known
        out = subprocess.run([str(driver), "-print-search-dirs"], capture_output=True,
                             text=True, timeout=30, check=False).stdout
        for line in out.splitlines():
            if line.startswith("install:"):
                install = Path(line.split(":", 1)[1].strip())
                prefix = str(install.parent.parent) + "/"
                self._exec_prefixes[driver] = prefix
                return prefix
        raise InferError(f"{driver} -print-search-dirs names no install directory")


class _Inferrer:
    def __init__(self, source_dir: Path, graph: BuildGraph, tools: Toolchain, *,
                 preprocess: bool) -> None:
        self.src = source_dir
        self.graph = graph
        self.tools = tools
        self.preprocess = preprocess
        self.scanner = IncludeScanner(source_dir)
        self.pool: ThreadPoolExecutor | None = None
        self._preprocessed: dict[tuple[str, ...], Future] = {}
        self._file_names: dict[str, str] = {}  # project file -> its name, hashed once
        self._header_lists: dict[tuple[str, ...], tuple[str, ...] | None] = {}
        self._warming: dict[str, Future] = {}

    def prepare(self, argv: list[str] | None) -> None:
        """Start the work of a step that can run ahead, on the pool: the tools it runs are
        located and hashed (the first time they are met), a compile that will be preprocessed
        here is preprocessed (all of them in parallel, as make -j would compile them). Here, on
        the calling thread meanwhile, a compile's headers are found and its files hashed."""
        if not argv or self.pool is None:
            return
        program = os.path.basename(argv[0])
        tool_kind = ("compiler" if _COMPILER.match(program)
                     else "tool" if _AR.match(program) or _RANLIB.match(program) else None)
        if tool_kind is not None and argv[0] not in self._warming:
            self._warming[argv[0]] = self.pool.submit(self._warm, argv[0], tool_kind)
        if tool_kind != "compiler" or "-c" not in argv:
            return
        try:
            driver, flags, source = self._compile_parts(argv)[:3]
        except InferError:
            return  # step() raises it again, in order
        key = (str(driver), *flags, source)
        preprocess = self.preprocess or not _inside_project(source)
        if not preprocess:
            if key not in self._header_lists:
                self._header_lists[key] = self._headers(driver, flags, source)
                for filename in (source, *(self._header_lists[key] or ())):
                    if (self.src / filename).is_file():
                        self._input(filename)  # hashed now, while the tools are
            preprocess = self._header_lists[key] is None
        if preprocess and key not in self._preprocessed:
            self._preprocessed[key] = self.pool.submit(self._preprocess, driver, flags, source)

    def _warm(self, program: str, kind: str) -> None:
        """Locate and hash a tool and, for a compiler driver, the programs it runs."""
        try:
            path = self.tools.which(program)
            self.tools.name_of(path)
            if kind == "compiler":
                self.tools.exec_prefix(path)
                for name in ("cc1", "as", "collect2", "ld"):
                    self.tools.name_of(self.tools.prog(path, name))
        except InferError:
            pass  # the step that needs it raises it, in order

    def wait_for_tools(self) -> None:
        for started in self._warming.values():
            started.result()

    # -- helpers -------------------------------------------------------------------------------

    def _exe(self, path: Path) -> str:
        name = self.tools.name_of(path)
        self.graph.values[name] = path
        self.graph.executables.add(name)
        return name

    def _input(self, filename: str) -> tuple[str, str]:
        """``(kind, name)`` of a step's input file: ``thunks`` for an earlier output, else
        ``values`` for a project file."""
        key = os.path.normpath(filename)
        if key in self.graph.producers:
            return "thunks", self.graph.producers[key]
        path = self.src / key
        if not path.is_file():
            raise InferError(f"input {filename!r} is neither a project file nor built earlier")
        name = self._file_names.get(key)
        if name is None:
            name = self._file_names[key] = file_name(path)
        self.graph.values[name] = path
        return "values", name

    def _add(self, kind: str, thunk: Thunk, output: str, inputs: list[str],
             headers: tuple[str, ...] = ()) -> None:
        if len(self.graph.steps) >= STEPS_MAX:
            raise InferError(f"more than {STEPS_MAX} build steps")
        self.graph.thunks[thunk.name] = thunk
        self.graph.producers[os.path.normpath(output)] = thunk.name
        self.graph.steps.append(Step(kind, output, thunk.name, tuple(inputs), headers))

    def _inputs_entries(self, files: list[str]) -> tuple[list[Entry], list[Entry]]:
        values: list[Entry] = []
        thunks: list[Entry] = []
        for filename in files:
            kind, name = self._input(filename)
            (thunks if kind == "thunks" else values).append((name, filename))
        return values, thunks

    # -- steps ---------------------------------------------------------------------------------

    def _compile_parts(self, argv: list[str]) -> tuple[Path, list[str], str, str, list[str]]:
        """``(driver, preprocessing flags, source, output, flags kept for the compile)``."""
        driver = self.tools.which(argv[0])
        keep: list[str] = []
        preprocess: list[str] = []
        sources: list[str] = []
        output: str | None = None
        words = iter(argv[1:])
        for word in words:
            if word == "-c":
                continue
            if word == "-o":
                output = next(words, None)
                if output is None:
                    raise InferError(f"-o without a file in {shlex.join(argv)}")
            elif word in _PREPROCESSOR_OPTIONS_WITH_ARG:
                preprocess += [word, next(words, "")]
            elif word in _DEPENDENCY_OPTIONS_WITH_ARG:
                next(words, None)
            elif word in _DEPENDENCY_FLAGS:
                continue
            elif word.startswith(_PREPROCESSOR_PREFIXES):
                preprocess.append(word)
            elif not word.startswith("-") and word.endswith(_SOURCE_SUFFIXES):
                sources.append(word)
            elif not word.startswith("-"):
                raise InferError(f"cannot compile {word!r} in {shlex.join(argv)}")
            else:
                keep.append(word)
        if len(sources) != 1:
            raise InferError(f"a compile step needs exactly one source: {shlex.join(argv)}")
        source = sources[0]
        output = output or str(Path(source).with_suffix(".o").name)
        return driver, [*preprocess, *keep], source, output, keep

    def compile(self, argv: list[str]) -> None:
        driver, flags, source, output, keep = self._compile_parts(argv)
        key = (str(driver), *flags, source)
        headers = (None if self.preprocess
                   else self._header_lists[key] if key in self._header_lists
                   else self._headers(driver, flags, source))
        if headers is None:
            self._compile_preprocessed(driver, flags, source, output, keep)
            return
        values, thunks = self._inputs_entries([source, *headers])
        thunk = Thunk(
            function_hash=self._exe(driver),
            args=("gcc", "-B", "bin/", *_without_dependency_options(argv[1:])),
            envars=(f"GCC_EXEC_PREFIX={self.tools.exec_prefix(driver)}",),
            values=values,
            thunks=thunks,
            executables=self._compiler_executables(driver),
            outputs=(output,),
        )
        self._add("compile", thunk, output, [source], headers)

    def _headers(self, driver: Path, flags: list[str], source: str) -> tuple[str, ...] | None:
        """The project headers a compile of ``source`` reads, so that its thunk can carry them
        (a header an earlier step makes is that step's output); ``None`` if it must be
        preprocessed here instead (a path outside the project)."""
        if not _inside_project(source):
            return None
        headers = self.scanner.headers(source, flags)
        if headers is None:
            headers = self._headers_from_compiler(driver, flags, source)
        return headers

    def _headers_from_compiler(self, driver: Path, flags: list[str],
                               source: str) -> tuple[str, ...] | None:
        """What ``cc -MM`` lists, when reading ``#include`` lines is not enough."""
        result = subprocess.run([str(driver), *flags, "-MM", source], cwd=self.src,
                                capture_output=True, timeout=PREPROCESS_TIMEOUT_S, check=False)
        if result.returncode != 0:
            raise InferError(f"finding the headers of {source} failed: "
                             f"{result.stderr.decode(errors='replace')[-2000:]}")
        headers = tuple(os.path.normpath(h) for h in _dependencies(result.stdout.decode())
                        if h != source)
        return headers if all(_inside_project(h) for h in headers) else None

    def _compiler_executables(self, driver: Path) -> tuple[Entry, ...]:
        return ((self._exe(driver), ""),
                (self._exe(self.tools.prog(driver, "cc1")), "bin/cc1"),
                (self._exe(self.tools.prog(driver, "as")), "bin/as"))

    def _compile_preprocessed(self, driver: Path, flags: list[str], source: str, output: str,
                              keep: list[str]) -> None:
        """gg's model: preprocess here, and the thunk compiles the ``.i`` value."""
        started = self._preprocessed.get((str(driver), *flags, source))
        preprocessed, headers = (started.result() if started is not None
                                 else self._preprocess(driver, flags, source))
        i_name = content_name(preprocessed)
        self.graph.values[i_name] = preprocessed
        i_file = str(Path(source).with_suffix(".i"))
        thunk = Thunk(
            function_hash=self._exe(driver),
            args=("gcc", *keep, "-B", "bin/", "-c", i_file, "-o", output),
            envars=(f"GCC_EXEC_PREFIX={self.tools.exec_prefix(driver)}",),
            values=((i_name, i_file),),
            executables=self._compiler_executables(driver),
            outputs=(output,),
        )
        self._add("compile", thunk, output, [source], headers)

    def _preprocess(self, driver: Path, flags: list[str], source: str) -> tuple[bytes, tuple]:
        with tempfile.TemporaryDirectory(prefix="gg-infer-") as tmp:
            dep_file = os.path.join(tmp, "deps.d")
            cmd = [str(driver), *flags, "-E", "-MMD", "-MF", dep_file, source]
            result = subprocess.run(cmd, cwd=self.src, capture_output=True,
                                    timeout=PREPROCESS_TIMEOUT_S, check=False)
            if result.returncode != 0:
                raise InferError(f"preprocessing {source} failed: "
                                 f"{result.stderr.decode(errors='replace')[-2000:]}")
            deps_text = Path(dep_file).read_text()
        headers = tuple(d for d in _dependencies(deps_text) if d != source)
        return result.stdout, headers

    def archive(self, argv: list[str]) -> None:
        if len(argv) < 3:
            raise InferError(f"cannot read archive step {shlex.join(argv)}")
        operation, archive, members = argv[1], argv[2], argv[3:]
        inputs = list(members)
        if os.path.normpath(archive) in self.graph.producers:
            inputs.append(archive)  # ar adds to an archive an earlier step made
        values, thunks = self._inputs_entries(inputs)
        tool = self.tools.which(argv[0])
        thunk = Thunk(function_hash=self._exe(tool), args=("ar", operation, archive, *members),
                      values=values, thunks=thunks, executables=((self._exe(tool), ""),),
                      outputs=(archive,))
        self._add("archive", thunk, archive, inputs)

    def ranlib(self, argv: list[str]) -> None:
        if len(argv) != 2:
            raise InferError(f"cannot read ranlib step {shlex.join(argv)}")
        archive = argv[1]
        values, thunks = self._inputs_entries([archive])
        tool = self.tools.which(argv[0])
        thunk = Thunk(function_hash=self._exe(tool), args=("ranlib", archive), values=values,
                      thunks=thunks, executables=((self._exe(tool), ""),), outputs=(archive,))
        self._add("ranlib", thunk, archive, [archive])

    def link(self, argv: list[str]) -> None:
        driver = self.tools.which(argv[0])
        output: str | None = None
        files: list[str] = []
        words = argv[1:]
        for index, word in enumerate(words):
            if word == "-o":
                output = words[index + 1] if index + 1 < len(words) else None
            elif (not word.startswith("-") and (index == 0 or words[index - 1] != "-o")):
                files.append(word)
        if output is None:
            output = "a.out"
        values, thunks = self._inputs_entries(files)
        thunk = Thunk(
            function_hash=self._exe(driver),
            args=("gcc", "-B", "bin/", *words),
            envars=(f"GCC_EXEC_PREFIX={self.tools.exec_prefix(driver)}",),
            values=values,
            thunks=thunks,
            executables=(
                (self._exe(driver), ""),
                (self._exe(self.tools.prog(driver, "collect2")), "bin/collect2"),
                (self._exe(self.tools.prog(driver, "ld")), "bin/ld"),
            ),
            outputs=(output,),
        )
        self._add("link", thunk, output, files)

    def step(self, line: str, argv: list[str] | None) -> None:
        """Add the thunk of one build command (``argv``: its words, None if it has shell
        syntax)."""
        if argv is None:
            raise InferError(f"shell syntax in a build command is not supported: {line!r}")
        if not argv:
            return
        program = os.path.basename(argv[0])
        if program in SKIPPED_COMMANDS:
            return
        if _COMPILER.match(program):
            (self.compile if "-c" in argv else self.link)(argv)
        elif _AR.match(program):
            self.archive(argv)
        elif _RANLIB.match(program):
            self.ranlib(argv)
        else:
            raise InferError(f"no model for build command {program!r} ({line!r})")


def _split(line: str) -> list[str] | None:
    """A command's words, or None if it uses shell syntax."""
    if _SHELL_SYNTAX.search(line):
        return None
    if not any(quote in line for quote in "'\"\\"):
        return line.split()  # what shlex.split gives for a line without quotes or escapes
    return shlex.split(line)


def _dependencies(rule: str) -> list[str]:
    """The prerequisites of a make rule as ``cc -MM`` and ``-MMD`` write it."""
    text = rule.replace("\\\n", " ")
    return text.split(":", 1)[1].split() if ":" in text else []


def _inside_project(relative: str) -> bool:
    path = os.path.normpath(relative)
    return not os.path.isabs(path) and path != ".." and not path.startswith("../")


def _without_dependency_options(words: list[str]) -> list[str]:
    """A compile's words without those that write a dependency file (a thunk's only outputs
    are the ones it declares)."""
    kept: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in _DEPENDENCY_OPTIONS_WITH_ARG:
            skip = True
        elif word not in _DEPENDENCY_FLAGS:
            kept.append(word)
    return kept


def make_commands(source_dir: Path, target: str, *, make: str = "make") -> list[str]:
    """The commands ``make -n -B TARGET`` prints in ``source_dir`` (every step, as if nothing
    was built)."""
    result = subprocess.run([make, "-n", "-B", "--no-print-directory", target], cwd=source_dir,
                            capture_output=True, text=True, timeout=MAKE_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise InferError(f"make -n {target} failed in {source_dir}: {result.stderr[-2000:]}")
    lines: list[str] = []
    pending = ""
    for raw in result.stdout.splitlines():
        if raw.endswith("\\"):
            pending += raw[:-1] + " "
            continue
        line = (pending + raw).strip()
        pending = ""
        if line and not line.startswith("make"):
            lines.append(line)
    return lines


def infer(source_dir: str | Path, target: str, *, make: str = "make",
          toolchain: Toolchain | None = None,
          preprocess: bool = False) -> tuple[BuildGraph, str]:
    """The thunk graph of building ``target`` in ``source_dir`` with make, and the reference of
    the thunk that produces it.

    A compile thunk carries its source and the project headers it includes as values at their
    paths and runs make's own command; with ``preprocess`` (gg's model), or for a source whose
    headers cannot be carried that way, the source is preprocessed here and the thunk compiles
    the ``.i`` value, needing no headers on the worker."""
    src = Path(source_dir).resolve()
    if not src.is_dir():
        raise InferError(f"{source_dir} is not a directory")
    graph = BuildGraph(source_dir=src)
    inferrer = _Inferrer(src, graph, toolchain or Toolchain(), preprocess=preprocess)
    lines = make_commands(src, target, make=make)
    words = {line: _split(line) for line in lines}
    with ThreadPoolExecutor(max_workers=PREPROCESS_THREADS) as pool:
        inferrer.pool = pool
        for line in lines:
            inferrer.prepare(words[line])
        inferrer.wait_for_tools()
        for line in lines:
            inferrer.step(line, words[line])
    return graph, graph.target(target)
