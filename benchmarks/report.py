"""Results of a comparison run: JSON on disk, a Markdown summary, PNG plots and a sanity check.

Every figure of a cell is the median over its measured rounds with the spread
(:mod:`benchmarks.spread`); ratios between peers are taken round by round (the rounds were
interleaved) and reported the same way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.spread import format_spread, paired_ratios, spread, spread_problems
from benchmarks.workloads import ROUND_FIGURES, KiB, MiB, format_size

POCKETFLOW_PEERS = ("pocketflow-dram", "pocketflow-nvme")
LOOPBACK_PEER = "tcp-native"
"""The loopback limit: every other peer is also reported as a fraction of it."""
BASELINE_PEERS = ("redis", "s3", "tcp", LOOPBACK_PEER)
PEER_ORDER = (*POCKETFLOW_PEERS, "pocketflow-dram-plain", "pocketflow-dram-tls", "redis", "s3",
              "tcp", LOOPBACK_PEER)
FIGURE_FIELDS = ROUND_FIGURES
"""Every measured cell carries these (medians over rounds), each finite and above zero, and
their spreads."""
RATIO_FIELDS = ("gb_per_s", "p50_us", "p99_us")
LOOPBACK_GOAL_FRACTION = 0.6
LOOPBACK_GOAL_SIZE_BYTES = 64 * MiB
"""Issue 30's goal: pocketflow's 64 MiB get and put at least 0.6 of the loopback limit."""


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


def _paired(cell: dict[str, Any], other: dict[str, Any], name: str) -> list[float]:
    """Round-by-round ratios of one figure; the ratio of the medians for a cell without
    per-round values."""
    mine = cell.get("per_round", {}).get(name)
    theirs = other.get("per_round", {}).get(name)
    if mine and theirs:
        return paired_ratios(mine, theirs)
    return [cell[name] / other[name]]


def compare_cells(cell: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """``cell`` / ``other`` for :data:`RATIO_FIELDS`: each the median of the round-by-round
    ratios, with ``spread`` and the number of round ``pairs``."""
    spreads = {name: spread(_paired(cell, other, name)) for name in RATIO_FIELDS}
    return {
        **{name: spreads[name]["median"] for name in RATIO_FIELDS},
        "spread": spreads,
        "pairs": len(_paired(cell, other, "gb_per_s")),
    }


def _coordinates(cell: dict[str, Any]) -> dict[str, Any]:
    return {k: cell[k] for k in ("op", "mode", "size_bytes", "clients")}


def _counterpart(result: dict[str, Any], cell: dict[str, Any], peer: str) -> dict[str, Any] | None:
    return find_cell(result, peer=peer, **_coordinates(cell))


def ratios(result: dict[str, Any]) -> list[dict[str, Any]]:
    """pocketflow / peer for every cell both measured: throughput and latency ratios.

    ``gb_per_s`` above 1 means pocketflow moved more bytes per second; ``p50_us`` and ``p99_us``
    below 1 mean pocketflow answered faster. Each is the median of the ratios of the rounds the
    two ran back to back, with their spread.
    """
    out = []
    for cell in measured(result):
        if cell["peer"] not in POCKETFLOW_PEERS:
            continue
        for baseline in BASELINE_PEERS:
            other = _counterpart(result, cell, baseline)
            if other is not None:
                out.append({"pocketflow": cell["peer"], "peer": baseline, **_coordinates(cell),
                            **compare_cells(cell, other)})
    return out


def loopback_fractions(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every other peer's throughput as a fraction of :data:`LOOPBACK_PEER`'s, cell by cell:
    ``fraction`` is the median of the round-by-round GB/s ratios, with ``spread``."""
    out = []
    for cell in measured(result):
        if cell["peer"] == LOOPBACK_PEER:
            continue
        limit = _counterpart(result, cell, LOOPBACK_PEER)
        if limit is None:
            continue
        values = _paired(cell, limit, "gb_per_s")
        summary = spread(values)
        out.append({"peer": cell["peer"], **_coordinates(cell), "fraction": summary["median"],
                    "spread": summary, "pairs": len(values)})
    return out


def tls_costs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """``pocketflow-dram-tls`` / ``pocketflow-dram-plain`` for every cell both measured (``--tls``):
    ``gb_per_s`` below 1 and ``p50_us`` above 1 are what TLS costs (round-by-round medians)."""
    out = []
    for cell in measured(result):
        if cell["peer"] != "pocketflow-dram-tls":
            continue
        plain = _counterpart(result, cell, "pocketflow-dram-plain")
        if plain is not None:
            out.append({**_coordinates(cell), **compare_cells(cell, plain)})
    return out


def _cell_problems(cell: dict[str, Any], plan: dict[str, Any]) -> list[str]:
    problems = []
    for name in FIGURE_FIELDS:
        value = cell.get(name)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            problems.append(f"{name} = {value!r}")
            continue
        problems += [f"{name}: {p}" for p in
                     spread_problems(cell.get("spread", {}).get(name), median=value)]
        per_round = cell.get("per_round", {}).get(name)
        if not isinstance(per_round, list) or len(per_round) != cell.get("rounds"):
            problems.append(f"{name}: per-round values {per_round!r} for {cell.get('rounds')} "
                            "rounds")
    rounds_min = plan.get("rounds_min")
    if rounds_min is not None and not (isinstance(cell.get("rounds"), int)
                                       and cell["rounds"] >= rounds_min):
        problems.append(f"{cell.get('rounds')!r} measured rounds, at least {rounds_min} planned")
    if "warmup_rounds" in plan and cell.get("warmup_rounds") != plan["warmup_rounds"]:
        problems.append(f"{cell.get('warmup_rounds')!r} warm-up rounds, "
                        f"{plan['warmup_rounds']} planned")
    for point in cell.get("cdf_us", []):
        if not all(math.isfinite(v) for v in point) or point[0] <= 0:
            problems.append(f"bad CDF point {point!r}")
            break
    return problems


def figure_problems(result: dict[str, Any]) -> list[str]:
    """Why the result is not a complete set of figures (empty when it is).

    Checks that the run recorded its commit, date and machine, that every planned cell was
    measured in at least the planned rounds after the planned warm-ups, that each cell's
    figures, spreads, ratios, loopback fractions and CDF points are finite and above zero, and
    that every peer has its fraction of the loopback limit when that peer ran. This checks the
    harness, never a speed.
    """
    problems = []
    for name in ("commit", "date", "machine", "versions", "plan", "peers", "cells"):
        if not result.get(name):
            problems.append(f"missing {name!r}")
    plan = result.get("plan", {})
    for cell in result.get("cells", []):
        where = (f"{cell.get('peer')} {cell.get('mode')} {cell.get('op')} "
                 f"{cell.get('size_bytes')} B x{cell.get('clients')}")
        if "error" in cell:
            problems.append(f"{where}: failed: {cell['error'].splitlines()[-1]}")
            continue
        problems += [f"{where}: {p}" for p in _cell_problems(cell, plan)]
    for peer, info in result.get("peers", {}).items():
        if info.get("error"):
            problems.append(f"{peer}: {info['error']}")
    for ratio in result.get("ratios", []):
        where = f"ratio {ratio['pocketflow']}/{ratio['peer']}"
        for name in RATIO_FIELDS:
            if not math.isfinite(ratio[name]) or ratio[name] <= 0:
                problems.append(f"{where} {name} = {ratio[name]}")
            problems += [f"{where} {name}: {p}" for p in
                         spread_problems(ratio.get("spread", {}).get(name), median=ratio[name])]
    fractions = result.get("loopback_limit", [])
    for fraction in fractions:
        problems += [f"{fraction['peer']} fraction of {LOOPBACK_PEER}: {p}" for p in
                     spread_problems(fraction.get("spread"), median=fraction["fraction"])]
    if any(c["peer"] == LOOPBACK_PEER for c in measured(result)):
        expected = sum(
            1 for c in measured(result)
            if c["peer"] != LOOPBACK_PEER and _counterpart(result, c, LOOPBACK_PEER)
        )
        if len(fractions) != expected:
            problems.append(f"{len(fractions)} fractions of {LOOPBACK_PEER}, {expected} cells")
    planned = plan.get("cells_planned")
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


def _spread_of(cell: dict[str, Any], name: str) -> str:
    """A cell's figure as ``median [min–max]`` (just the median for a cell without spread)."""
    summary = cell.get("spread", {}).get(name)
    return format_spread(summary) if summary else _fmt(cell[name])


def _ratio_text(entry: dict[str, Any], name: str) -> str:
    summary = entry.get("spread", {}).get(name)
    if not summary:
        return f"{entry[name]:.2f}"
    return f"{summary['median']:.2f} [{summary['min']:.2f}–{summary['max']:.2f}]"


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _rounds_line(result: dict[str, Any]) -> str:
    plan = result.get("plan", {})
    rounds = [c["rounds"] for c in measured(result) if "rounds" in c]
    counted = (f"{min(rounds)}-{max(rounds)}" if rounds and min(rounds) != max(rounds)
               else str(rounds[0]) if rounds else "?")
    return (
        f"- every figure is the median over {counted} measured rounds with its range "
        f"[lowest–highest round], after {plan.get('warmup_rounds', '?')} warm-up rounds per "
        "peer and cell that are discarded; the peers take turns round by round (the order "
        "rotating), and ratios are medians of the round-by-round ratios"
    )


def _ratio_tables(result: dict[str, Any]) -> list[str]:
    one_client_ratios = [r for r in result.get("ratios", []) if r["clients"] == 1]
    if not one_client_ratios:
        return []
    pairs = sorted(
        {(r["pocketflow"], r["peer"]) for r in one_client_ratios},
        key=lambda p: (_peer_rank(p[0]), _peer_rank(p[1])),
    )
    keyed = {
        (r["mode"], r["size_bytes"], r["op"], r["pocketflow"], r["peer"]): r
        for r in one_client_ratios
    }
    coordinates = sorted(
        {(r["mode"], r["size_bytes"], r["op"]) for r in one_client_ratios},
        key=lambda k: (k[0] != "single", k[1], k[2] != "put"),
    )
    header = ["object", "op"] + [f"{p.removeprefix('pocketflow-')}/{b}" for p, b in pairs]
    lines: list[str] = []
    for name, title in (
        ("gb_per_s", "Throughput ratio (GB/s; above 1 = pocketflow faster)"),
        ("p50_us", "p50 latency ratio (below 1 = pocketflow faster)"),
    ):
        rows = []
        for mode, size, op in coordinates:
            row = [format_size(size) + (" batch" if mode == "batch" else ""), op]
            for pair in pairs:
                r = keyed.get((mode, size, op, *pair))
                row.append("-" if r is None else _ratio_text(r, name))
            rows.append(row)
        lines += [f"{title}, median [range] of the round pairs.", "", *_table(header, rows), ""]
    return ["## pocketflow / peer, one client", "", *lines]


def _loopback_table(result: dict[str, Any]) -> list[str]:
    fractions = [f for f in result.get("loopback_limit", []) if f["clients"] == 1]
    if not fractions:
        return []
    peers = sorted({f["peer"] for f in fractions}, key=_peer_rank)
    keyed = {(f["mode"], f["size_bytes"], f["op"], f["peer"]): f for f in fractions}
    coordinates = sorted(
        {(f["mode"], f["size_bytes"], f["op"]) for f in fractions},
        key=lambda k: (k[0] != "single", k[1], k[2] != "put"),
    )
    rows = []
    for mode, size, op in coordinates:
        row = [format_size(size) + (" batch" if mode == "batch" else ""), op]
        for peer in peers:
            f = keyed.get((mode, size, op, peer))
            row.append("-" if f is None else
                       f"{f['fraction']:.2f} [{f['spread']['min']:.2f}–{f['spread']['max']:.2f}]")
        rows.append(row)
    lines = [
        f"## Against the loopback limit ({LOOPBACK_PEER}), one client",
        "",
        f"Each peer's GB/s as a fraction of `{LOOPBACK_PEER}` (a Rust client and server that "
        "move the same request and response shapes over 127.0.0.1 and store nothing), median "
        "[range] of the round pairs. `tcp` is the same framing with a Python client and server: "
        "its fraction is what the client's language costs. A fraction above 1 is a peer that "
        "beat the native client in that cell (around 1 MiB it can: benchmarks/README.md).",
        "",
        *_table(["object", "op", *peers], rows),
        "",
    ]
    goal = [f for f in fractions if f["peer"] in POCKETFLOW_PEERS and f["mode"] == "single"
            and f["size_bytes"] == LOOPBACK_GOAL_SIZE_BYTES]
    if goal:
        lines.append(
            f"Goal (issue 30): pocketflow's {format_size(LOOPBACK_GOAL_SIZE_BYTES)} put and get "
            f"at least {LOOPBACK_GOAL_FRACTION} of the limit: " + "; ".join(
                f"{f['peer']} {f['op']} {f['fraction']:.2f} "
                f"({'met' if f['fraction'] >= LOOPBACK_GOAL_FRACTION else 'missed'})"
                for f in sorted(goal, key=lambda f: (_peer_rank(f["peer"]), f["op"] != "put"))
            )
        )
        lines.append("")
    return lines


def summary_markdown(result: dict[str, Any]) -> str:
    """A short Markdown summary: one-client figures, the loopback limit, ratios, scaling with
    clients, batches; every figure a median with its range over rounds."""
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
        "GB/s is 10^9 bytes/s over the wall-clock time of a round's phase; latency per "
        "operation.",
        _rounds_line(result),
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
            [[format_size(c["size_bytes"]), c["op"], c["peer"], _spread_of(c, "p50_us"),
              _spread_of(c, "p99_us"), _spread_of(c, "ops_per_s"), _spread_of(c, "gb_per_s")]
             for c in rows],
        )
        lines.append("")
    lines += _loopback_table(result)
    lines += _ratio_tables(result)
    client_counts = sorted({c["clients"] for c in cells if c["mode"] == "single"})
    if len(client_counts) > 1:
        lines += [
            "## Concurrent client processes",
            "",
            "Aggregate GB/s (ops/s for objects up to 64 KiB) by number of client processes, "
            "median [range] over rounds.",
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
                row.append("-" if cell is None else _spread_of(cell, metric))
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
              c["peer"], _spread_of(c, "ops_per_s"), _spread_of(c, "p50_us"),
              _spread_of(c, "p99_us")]
             for c in rows],
        )
        lines.append("")
    costs = tls_costs(result)
    if costs:
        lines += ["## What TLS costs (one DRAM server, TLS / plaintext)", ""]
        lines += _table(
            ["object", "op", "mode", "clients", "throughput TLS/plain", "p50 TLS/plain"],
            [[format_size(c["size_bytes"]), c["op"], c["mode"], str(c["clients"]),
              _ratio_text(c, "gb_per_s"), _ratio_text(c, "p50_us")]
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


def _with_range(ax: Any, points: list[tuple[float, float, float, float]], **style: Any) -> None:
    """Plot ``(x, median, low, high)`` points as a line with error bars from low to high."""
    xs, ys, lows, highs = zip(*sorted(points), strict=True)
    errors = [[y - lo for y, lo in zip(ys, lows, strict=True)],
              [hi - y for y, hi in zip(ys, highs, strict=True)]]
    ax.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, **style)


def _cell_point(cell: dict[str, Any], x: float, metric: str) -> tuple[float, float, float, float]:
    summary = cell.get("spread", {}).get(metric) or {"min": cell[metric], "max": cell[metric]}
    return (x, cell[metric], summary["min"], summary["max"])


def plot(result: dict[str, Any], stem: Path) -> list[Path]:
    """Latency CDF (1 KiB), throughput vs object size, throughput vs clients, fraction of the
    loopback limit vs object size; PNG paths. Throughputs are medians with error bars from the
    lowest to the highest round."""
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
            ax.set_title(f"1 KiB {op}, one client, every measured round")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("fraction of operations")
        axes[1].legend(loc="lower right")
        written.append(_save(fig, stem, "latency-cdf-1KiB"))

    single = [c for c in cells if c["mode"] == "single" and c["clients"] == 1]
    sizes = sorted({c["size_bytes"] for c in single})
    if len(sizes) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, op in zip(axes, ("put", "get"), strict=True):
            for peer in peers:
                points = [_cell_point(c, c["size_bytes"], "gb_per_s") for c in single
                          if c["peer"] == peer and c["op"] == op]
                if points:
                    _with_range(ax, points, label=peer)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [format_size(s) for s in sizes])
            ax.set_xlabel("object size")
            ax.set_title(f"{op} throughput, one client (median, range over rounds)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("GB/s (log scale)")
        axes[1].legend(loc="lower right")
        written.append(_save(fig, stem, "throughput-vs-size"))

    multi = [c for c in cells if c["mode"] == "single"]
    counts = sorted({c["clients"] for c in multi})
    if len(counts) > 1:
        multi_sizes = sorted({c["size_bytes"] for c in multi})
        small = multi_sizes[0]
        large = max((s for s in multi_sizes if s <= MiB), default=multi_sizes[-1])
        rows = [(small, "ops_per_s", "ops/s")]
        if large != small:
            rows.append((large, "gb_per_s", "GB/s"))
        fig, axes = plt.subplots(len(rows), 2, figsize=(11, 4 * len(rows)), squeeze=False)
        for row, (size, metric, label) in enumerate(rows):
            for col, op in enumerate(("put", "get")):
                ax = axes[row][col]
                for peer in peers:
                    points = [_cell_point(c, c["clients"], metric) for c in multi
                              if c["peer"] == peer and c["op"] == op and c["size_bytes"] == size]
                    if points:
                        _with_range(ax, points, label=peer)
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xticks(counts, [str(n) for n in counts])
                ax.set_xlabel("client processes")
                ax.set_ylabel(f"{label} (log scale)")
                ax.set_title(f"{format_size(size)} {op}")
                ax.grid(True, which="both", alpha=0.3)
        axes[0][1].legend(loc="best")
        written.append(_save(fig, stem, "throughput-vs-clients"))

    fractions = [f for f in result.get("loopback_limit", [])
                 if f["mode"] == "single" and f["clients"] == 1]
    if fractions:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, op in zip(axes, ("put", "get"), strict=True):
            for peer in sorted({f["peer"] for f in fractions}, key=_peer_rank):
                points = [(f["size_bytes"], f["fraction"], f["spread"]["min"],
                           f["spread"]["max"])
                          for f in fractions if f["peer"] == peer and f["op"] == op]
                if points:
                    _with_range(ax, points, label=peer)
            ax.axhline(LOOPBACK_GOAL_FRACTION, color="grey", linestyle="--", linewidth=1)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            fraction_sizes = sorted({f["size_bytes"] for f in fractions})
            ax.set_xticks(fraction_sizes, [format_size(s) for s in fraction_sizes])
            ax.set_xlabel("object size")
            ax.set_title(f"{op}: fraction of {LOOPBACK_PEER}'s GB/s, one client")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel(f"GB/s / {LOOPBACK_PEER} GB/s (log scale)")
        axes[1].legend(loc="lower right")
        written.append(_save(fig, stem, "loopback-fraction"))
    return written


def _save(fig: Any, stem: Path, name: str) -> Path:
    import matplotlib.pyplot as plt

    path = stem.with_name(f"{stem.name}-{name}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
