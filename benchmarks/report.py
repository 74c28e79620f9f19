"""Results of a comparison run: JSON on disk, a Markdown summary, PNG plots and a sanity check."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.workloads import KiB, MiB, format_size

POCKETFLOW_PEERS = ("pocketflow-dram", "pocketflow-nvme")
BASELINE_PEERS = ("redis", "s3", "tcp")
PEER_ORDER = (*POCKETFLOW_PEERS, "pocketflow-dram-plain", "pocketflow-dram-tls", "redis", "s3",
              "tcp")
FIGURE_FIELDS = ("ops_per_s", "gb_per_s", "p50_us", "p99_us")
"""Every measured cell carries these, each finite and above zero."""


def _peer_rank(name: str) -> int:
    return PEER_ORDER.index(name) if name in PEER_ORDER else len(PEER_ORDER)


def measured(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The cells that were measured (not those that failed)."""
    return [c for c in result["cells"] if "error" not in c]


def find_cell(
    result: dict[str, Any], *, peer: str, op: str, size_bytes: int, clients: int,
    mode: str = "single",
) -> dict[str, Any] | None:
    """The measured cell with these coordinates, if any."""
    for cell in measured(result):
        if (cell["peer"], cell["op"], cell["size_bytes"], cell["clients"], cell["mode"]) == (
            peer, op, size_bytes, clients, mode,
        ):
            return cell
    return None


def ratios(result: dict[str, Any]) -> list[dict[str, Any]]:
    """pocketflow / peer for every cell both measured: throughput and latency ratios.

    ``gb_per_s`` above 1 means pocketflow moved more bytes per second; ``p50_us`` and ``p99_us``
    below 1 mean pocketflow answered faster.
    """
    out = []
    for cell in measured(result):
        if cell["peer"] not in POCKETFLOW_PEERS:
            continue
        for baseline in BASELINE_PEERS:
            other = find_cell(
                result, peer=baseline, op=cell["op"], size_bytes=cell["size_bytes"],
                clients=cell["clients"], mode=cell["mode"],
            )
            if other is None:
                continue
            out.append({
                "pocketflow": cell["peer"], "peer": baseline, "op": cell["op"],
                "mode": cell["mode"], "size_bytes": cell["size_bytes"], "clients": cell["clients"],
                "gb_per_s": cell["gb_per_s"] / other["gb_per_s"],
                "p50_us": cell["p50_us"] / other["p50_us"],
                "p99_us": cell["p99_us"] / other["p99_us"],
            })
    return out


def tls_costs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """``pocketflow-dram-tls`` / ``pocketflow-dram-plain`` for every cell both measured (``--tls``):
    ``gb_per_s`` below 1 and ``p50_us`` above 1 are what TLS costs."""
    out = []
    for cell in measured(result):
        if cell["peer"] != "pocketflow-dram-tls":
            continue
        plain = find_cell(
            result, peer="pocketflow-dram-plain", op=cell["op"], size_bytes=cell["size_bytes"],
            clients=cell["clients"], mode=cell["mode"],
        )
        if plain is None:
            continue
        out.append({
            "op": cell["op"], "mode": cell["mode"], "size_bytes": cell["size_bytes"],
            "clients": cell["clients"],
            "gb_per_s": cell["gb_per_s"] / plain["gb_per_s"],
            "p50_us": cell["p50_us"] / plain["p50_us"],
        })
    return out


def figure_problems(result: dict[str, Any]) -> list[str]:
    """Why the result is not a complete set of figures (empty when it is).

    Checks that the run recorded its commit, date and machine, that every planned cell was
    measured, and that each cell's figures, ratios and CDF points are finite and above zero.
    This checks the harness, never a speed.
    """
    problems = []
    for name in ("commit", "date", "machine", "versions", "plan", "peers", "cells"):
        if not result.get(name):
            problems.append(f"missing {name!r}")
    for cell in result.get("cells", []):
        where = (f"{cell.get('peer')} {cell.get('mode')} {cell.get('op')} "
                 f"{cell.get('size_bytes')} B x{cell.get('clients')}")
        if "error" in cell:
            problems.append(f"{where}: failed: {cell['error'].splitlines()[-1]}")
            continue
        for name in FIGURE_FIELDS:
            value = cell.get(name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                problems.append(f"{where}: {name} = {value!r}")
        for point in cell.get("cdf_us", []):
            if not all(math.isfinite(v) for v in point) or point[0] <= 0:
                problems.append(f"{where}: bad CDF point {point!r}")
                break
    for peer, info in result.get("peers", {}).items():
        if info.get("error"):
            problems.append(f"{peer}: {info['error']}")
    for ratio in result.get("ratios", []):
        for name in ("gb_per_s", "p50_us", "p99_us"):
            if not math.isfinite(ratio[name]) or ratio[name] <= 0:
                problems.append(
                    f"ratio {ratio['pocketflow']}/{ratio['peer']} {name} = {ratio[name]}"
                )
    planned = result.get("plan", {}).get("cells_planned")
    if planned is not None and len(result.get("cells", [])) != planned:
        problems.append(f"{len(result.get('cells', []))} cells recorded, {planned} planned")
    return problems


def write_json(result: dict[str, Any], path: Path) -> None:
    """Write the result as indented JSON."""
    path.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")


# -- Markdown -----------------------------------------------------------------------------------


def _fmt(value: float, digits: int = 3) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def summary_markdown(result: dict[str, Any]) -> str:
    """A short Markdown summary: one-client figures, ratios, scaling with clients, batches."""
    cells = measured(result)
    machine = result["machine"]
    versions = result["versions"]
    commit = result["commit"]
    lines = [
        f"# pocketflow vs Redis, S3 (SeaweedFS) and raw TCP: {result['mode']} run",
        "",
        f"- commit `{(commit.get('commit') or 'unknown')[:12]}`"
        + (" with uncommitted changes" if commit.get("dirty") else "")
        + (f", {untracked} untracked files" if (untracked := commit.get("untracked_files")) else "")
        + f", {result['date']}, {result['elapsed_s']:.0f} s",
        f"- {machine.get('cpu_model')}, {machine.get('cores')} cores, "
        f"{(machine.get('memory_bytes') or 0) / 2**30:.0f} GiB, kernel {machine.get('kernel')}, "
        f"load average {machine.get('load_avg_1m_at_start', 0):.2f} at start, "
        f"{machine.get('load_avg_1m_at_end', 0):.2f} at end (the run's own client processes "
        "count)",
        "- " + ", ".join(f"{k} {v}" for k, v in versions.items() if v),
        "- every peer, server and client process on this one machine, over 127.0.0.1; "
        "GB/s is 10^9 bytes/s over the wall-clock time of the phase; latency per operation.",
        "",
    ]
    single = [c for c in cells if c["mode"] == "single" and c["clients"] == 1]
    if single:
        lines += ["## One client", ""]
        rows = sorted(
            single, key=lambda c: (c["size_bytes"], c["op"] != "put", _peer_rank(c["peer"]))
        )
        lines += _table(
            ["object", "op", "peer", "p50 µs", "p99 µs", "ops/s", "GB/s"],
            [[format_size(c["size_bytes"]), c["op"], c["peer"], _fmt(c["p50_us"]),
              _fmt(c["p99_us"]), _fmt(c["ops_per_s"]), _fmt(c["gb_per_s"])] for c in rows],
        )
        lines.append("")
    one_client_ratios = [r for r in result.get("ratios", []) if r["clients"] == 1]
    if one_client_ratios:
        pairs = sorted(
            {(r["pocketflow"], r["peer"]) for r in one_client_ratios},
            key=lambda p: (_peer_rank(p[0]), _peer_rank(p[1])),
        )
        lines += [
            "## pocketflow / peer, one client",
            "",
            "Throughput ratio (GB/s; above 1 = pocketflow faster), and p50 latency ratio in "
            "parentheses (below 1 = pocketflow faster).",
            "",
        ]
        keyed = {
            (r["mode"], r["size_bytes"], r["op"], r["pocketflow"], r["peer"]): r
            for r in one_client_ratios
        }
        rows = []
        coordinates = sorted(
            {(r["mode"], r["size_bytes"], r["op"]) for r in one_client_ratios},
            key=lambda k: (k[0] != "single", k[1], k[2] != "put"),
        )
        for mode, size, op in coordinates:
            row = [format_size(size) + (" batch" if mode == "batch" else ""), op]
            for pair in pairs:
                r = keyed.get((mode, size, op, *pair))
                row.append("-" if r is None else f"{r['gb_per_s']:.2f} ({r['p50_us']:.2f})")
            rows.append(row)
        header = ["object", "op"] + [
            f"{p.removeprefix('pocketflow-')}/{b}" for p, b in pairs
        ]
        lines += _table(header, rows)
        lines.append("")
    client_counts = sorted({c["clients"] for c in cells if c["mode"] == "single"})
    if len(client_counts) > 1:
        lines += [
            "## Concurrent client processes",
            "",
            "Aggregate GB/s (ops/s for objects up to 64 KiB) by number of client processes.",
            "",
        ]
        rows = []
        keys = sorted(
            {(c["size_bytes"], c["op"], c["peer"]) for c in cells if c["mode"] == "single"},
            key=lambda k: (k[0], k[1] != "put", _peer_rank(k[2])),
        )
        for size, op, peer in keys:
            row = [format_size(size), op, peer]
            for count in client_counts:
                cell = find_cell(result, peer=peer, op=op, size_bytes=size, clients=count)
                metric = "ops_per_s" if size <= 64 * KiB else "gb_per_s"
                row.append("-" if cell is None else _fmt(cell[metric]))
            rows.append(row)
        lines += _table(["object", "op", "peer", *map(str, client_counts)], rows)
        lines.append("")
    batch = [c for c in cells if c["mode"] == "batch"]
    if batch:
        lines += ["## Pipelined batches (put_many / get_many, a Redis pipeline)", ""]
        rows = sorted(batch, key=lambda c: (c["size_bytes"], c["clients"], c["op"] != "put",
                                            _peer_rank(c["peer"])))
        lines += _table(
            ["object", "batch", "clients", "op", "peer", "ops/s", "p50 µs per batch",
             "p99 µs per batch"],
            [[format_size(c["size_bytes"]), str(c["batch_ops"]), str(c["clients"]), c["op"],
              c["peer"], _fmt(c["ops_per_s"]), _fmt(c["p50_us"]), _fmt(c["p99_us"])]
             for c in rows],
        )
        lines.append("")
    costs = tls_costs(result)
    if costs:
        lines += ["## What TLS costs (one DRAM server, TLS / plaintext)", ""]
        lines += _table(
            ["object", "op", "mode", "clients", "throughput TLS/plain", "p50 TLS/plain"],
            [[format_size(c["size_bytes"]), c["op"], c["mode"], str(c["clients"]),
              _fmt(c["gb_per_s"]), _fmt(c["p50_us"])]
             for c in sorted(costs, key=lambda c: (c["mode"], c["size_bytes"], c["clients"],
                                                   c["op"]))],
        )
        lines.append("")
    notes = [
        f"- {peer}: {'; '.join(info['notes'])}"
        for peer, info in sorted(result["peers"].items(), key=lambda kv: _peer_rank(kv[0]))
        if info.get("notes")
    ]
    errors = [c for c in result["cells"] if "error" in c]
    errors_text = [
        f"- {c['peer']} {c['op']} {format_size(c['size_bytes'])} x{c['clients']}: "
        f"{c['error'].strip().splitlines()[-1]}" for c in errors
    ]
    errors_text += [
        f"- {peer}: {info['error']}" for peer, info in result["peers"].items() if info.get("error")
    ]
    if notes:
        lines += ["## Notes", "", *notes, ""]
    if errors_text:
        lines += ["## Failures", "", *errors_text, ""]
    if result.get("plots"):
        lines += ["## Plots", "", *(f"![{Path(p).stem}]({Path(p).name})" for p in result["plots"]),
                  ""]
    return "\n".join(lines)


# -- plots --------------------------------------------------------------------------------------


def plot(result: dict[str, Any], stem: Path) -> list[Path]:
    """Latency CDF (1 KiB), throughput vs object size, throughput vs clients; PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = measured(result)
    peers = sorted({c["peer"] for c in cells}, key=_peer_rank)
    written = []

    cdf_cells = [c for c in cells if c.get("cdf_us")]
    if cdf_cells:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, op in zip(axes, ("put", "get"), strict=True):
            for peer in peers:
                for c in cdf_cells:
                    if c["peer"] == peer and c["op"] == op:
                        xs, ys = zip(*c["cdf_us"], strict=True)
                        ax.plot(xs, ys, label=peer)
            ax.set_xscale("log")
            ax.set_xlabel("latency (µs, log scale)")
            ax.set_title(f"1 KiB {op}, one client")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("fraction of operations")
        axes[1].legend(loc="lower right")
        written.append(_save(fig, stem, "latency-cdf-1KiB"))

    single = [c for c in cells if c["mode"] == "single" and c["clients"] == 1]
    if len({c["size_bytes"] for c in single}) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, op in zip(axes, ("put", "get"), strict=True):
            for peer in peers:
                points = sorted(
                    (c["size_bytes"], c["gb_per_s"]) for c in single
                    if c["peer"] == peer and c["op"] == op
                )
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, marker="o", label=peer)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            sizes = sorted({c["size_bytes"] for c in single})
            ax.set_xticks(sizes, [format_size(s) for s in sizes])
            ax.set_xlabel("object size")
            ax.set_title(f"{op} throughput, one client")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("GB/s (log scale)")
        axes[1].legend(loc="lower right")
        written.append(_save(fig, stem, "throughput-vs-size"))

    multi = [c for c in cells if c["mode"] == "single"]
    counts = sorted({c["clients"] for c in multi})
    if len(counts) > 1:
        sizes = sorted({c["size_bytes"] for c in multi})
        small = sizes[0]
        large = max((s for s in sizes if s <= MiB), default=sizes[-1])
        rows = [(small, "ops_per_s", "ops/s")]
        if large != small:
            rows.append((large, "gb_per_s", "GB/s"))
        fig, axes = plt.subplots(len(rows), 2, figsize=(11, 4 * len(rows)), squeeze=False)
        for row, (size, metric, label) in enumerate(rows):
            for col, op in enumerate(("put", "get")):
                ax = axes[row][col]
                for peer in peers:
                    points = sorted(
                        (c["clients"], c[metric]) for c in multi
                        if c["peer"] == peer and c["op"] == op and c["size_bytes"] == size
                    )
                    if points:
                        xs, ys = zip(*points, strict=True)
                        ax.plot(xs, ys, marker="o", label=peer)
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xticks(counts, [str(n) for n in counts])
                ax.set_xlabel("client processes")
                ax.set_ylabel(f"{label} (log scale)")
                ax.set_title(f"{format_size(size)} {op}")
                ax.grid(True, which="both", alpha=0.3)
        axes[0][1].legend(loc="best")
        written.append(_save(fig, stem, "throughput-vs-clients"))
    return written


def _save(fig: Any, stem: Path, name: str) -> Path:
    import matplotlib.pyplot as plt

    path = stem.with_name(f"{stem.name}-{name}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
