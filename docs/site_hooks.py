"""mkdocs hook of the docs site: its pages are the repository's own Markdown files, at their own
paths, so every relative link that works on a source checkout (README.md ->
docs/ARCHITECTURE.md, -> benchmarks/results/*.png, -> examples/cluster.yaml) works on the site
unchanged, and `mkdocs build --strict` fails on one that does not.

`docs/site/` (the configured docs_dir) holds the pages written for the site: installing, the
API reference, the dashboard. They too keep their checkout paths (`docs/site/install.md`), so
links to and from them also read the same on a checkout and on the site. The files listed in
SITE_SOURCES are read in place; nothing is copied into the source tree.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

SITE_SOURCES = (
    "README.md",
    "docs/*.md",
    "adapters/*/README.md",
    "benchmarks/README.md",
    "benchmarks/results/*",
    "examples/*",
)
"""Repository files (globs from the checkout's root) that are pages or assets of the site."""


SPHINX_ROLE = re.compile(r":(?:class|meth|func|mod|attr|exc|data|obj):(?=<code>)")
"""A Sphinx cross-reference role before the code span mkdocstrings rendered its target as (the
docstrings write ``:class:`Client```): the role's name is dropped, the code span stays."""

SITE_PAGES_DIR = "docs/site"
"""The docs_dir of mkdocs.yml, as a path in the checkout."""


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Put every page and asset under its path in the checkout."""
    root = Path(config.config_file_path).resolve().parent
    for own in list(files):
        if own.abs_src_path and Path(own.abs_src_path).is_relative_to(root / SITE_PAGES_DIR):
            files.remove(own)
            files.append(File.generated(config, f"{SITE_PAGES_DIR}/{own.src_uri}",
                                        abs_src_path=own.abs_src_path))
    for pattern in SITE_SOURCES:
        for path in sorted(root.glob(pattern)):
            if path.is_file():
                src_uri = path.relative_to(root).as_posix()
                files.append(File.generated(config, src_uri, abs_src_path=str(path)))
    return files


def on_page_content(html: str, **_: object) -> str:
    """Drop the Sphinx role names of the docstrings' cross-references from the rendered API."""
    return SPHINX_ROLE.sub("", html)
