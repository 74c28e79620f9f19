"""Command-line options of the comparison runner, importable without its dependencies.

``pocketflow bench`` (``pocketflow/cli.py``) adds these to its subcommand with
:func:`add_arguments` and hands the parsed namespace to
:func:`benchmarks.compare.main_from_args`; importing this module costs nothing beyond argparse.
"""

from __future__ import annotations

import argparse
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PEER_NAMES = ("tcp", "tcp-native", "redis", "s3", "pocketflow-dram", "pocketflow-nvme")
"""``tcp-native`` is the loopback limit (a Rust client and server, built by ``make install``);
``tcp`` the same framing with a Python client and server."""
TLS_PEER_NAMES = ("pocketflow-dram-plain", "pocketflow-dram-tls")
"""Added by ``--tls``: one standalone DRAM server each, plaintext and TLS, otherwise equal."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--quick`` (default) or ``--full``, ``--peers``, ``--out``, ``--no-plots``, ``--sizes``,
    ``--clients``, ``--tls``."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="smoke run, under 2 minutes (default)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="every size (1 KiB..64 MiB) and 1..16 client processes")
    parser.set_defaults(mode="quick")
    parser.add_argument("--peers", default=",".join(PEER_NAMES),
                        help=f"comma-separated subset of {','.join(PEER_NAMES)} (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR,
                        help=f"directory for the results (default {RESULTS_DIR})")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--sizes", default=None, metavar="SIZES",
                        help="run only the single cells of these object sizes, comma-separated "
                        "(e.g. 64MiB), and no batch cells")
    parser.add_argument("--clients", default=None, metavar="COUNTS",
                        help="run only the single cells of these client counts, comma-separated "
                        "(e.g. 1), and no batch cells")
    parser.add_argument("--tls", action="store_true",
                        help="also run one standalone DRAM server in plaintext and one with TLS "
                        "(pocketflow-dram-plain, pocketflow-dram-tls) and report what TLS costs")
