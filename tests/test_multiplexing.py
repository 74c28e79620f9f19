"""The capacity-multiplexing simulator (Jiffy Figure 9(a) shape): pure, no cluster."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pocketflow.control.multiplexing import (
    GB,
    DagJob,
    MuxConfig,
    main,
    peak_capacity,
    run_figure,
    simulate,
    staggered_trace,
)


@pytest.fixture(scope="module")
def figure() -> dict:
    return run_figure(staggered_trace(12))


def _row(figure: dict, fraction: float, scheme: str) -> dict:
    return next(r for r in figure["rows"]
                if r["capacity_fraction"] == fraction and r["scheme"] == scheme)


def test_full_capacity_slows_nothing_and_prefix_leases_use_what_they_allocate(figure) -> None:
    for scheme in ("job", "prefix"):
        assert _row(figure, 1.0, scheme)["slowdown_max"] == pytest.approx(1.0)
        assert _row(figure, 1.0, scheme)["spilled_bytes"] < 1.0  # bytes; float rounding
    # Job-level reservations sit idle most of a job's life; prefix allocations do not.
    for fraction in (1.0, 0.5, 0.2):
        assert _row(figure, fraction, "prefix")["utilization"] >= 0.8
        assert _row(figure, fraction, "job")["utilization"] < 0.8


def test_prefix_leases_slow_jobs_less_when_capacity_is_short(figure) -> None:
    for fraction in (0.5, 0.2):
        job, prefix = _row(figure, fraction, "job"), _row(figure, fraction, "prefix")
        assert prefix["slowdown_mean"] < job["slowdown_mean"]
        assert prefix["spilled_bytes"] < job["spilled_bytes"]
    # Less capacity never speeds a scheme up.
    for scheme in ("job", "prefix"):
        assert (_row(figure, 0.2, scheme)["slowdown_mean"]
                >= _row(figure, 0.5, scheme)["slowdown_mean"] - 1e-9)


def test_a_lone_job_spills_only_what_does_not_fit() -> None:
    job = DagJob("one", 0.0, (4 * GB, 0), (16, 8), compute_s=1.0)
    peak = peak_capacity([job])
    assert peak == pytest.approx(4 * GB)
    half = simulate([job], peak / 2, "prefix")
    assert half.spilled_bytes == pytest.approx(2 * GB, rel=0.01)
    assert simulate([job], peak, "job").spilled_bytes == 0
    with pytest.raises(ValueError):
        simulate([job], peak, "per-object")
    with pytest.raises(ValueError):
        DagJob("bad", 0.0, (1,), (0,))


def test_a_reader_gives_dram_back_as_it_reads() -> None:
    # A's two reducers read 2 GB each for about 27 s; B writes 100 MB ten seconds into that read,
    # when A's data fills all of DRAM at the start of the read. DELETE-on-read frees each part
    # as it is read, so B finds room without waiting and spills nothing.
    a = DagJob("a", 0.0, (4 * GB, 0), (2, 2), compute_s=1.0)
    b = DagJob("b", 37.0, (GB // 10, 0), (1, 1), compute_s=1.0)
    result = simulate([a, b], 4 * GB, "prefix")
    assert result.spilled_bytes == 0
    alone = simulate([b], float("inf"), "prefix").completion_s[0]
    assert result.completion_s[1] == pytest.approx(alone)


def test_parked_readers_take_written_parts_while_a_spilled_writer_is_still_writing() -> None:
    # Two writers of 1 GB each, DRAM for one: the second spills (five times slower). Parked,
    # the reader reads and deletes the first part while the second is still being written;
    # stage by stage, that part sits in DRAM until the slow writer is done.
    job = DagJob("one", 0.0, (2 * GB, 0), (2, 1), compute_s=1.0)
    config = MuxConfig(wait_max_s=0.0)
    barrier = simulate([job], GB, "prefix", config)
    parked = simulate([job], GB, "prefix", replace(config, readers="park"))
    assert barrier.spilled_bytes == pytest.approx(GB) == parked.spilled_bytes
    dram_s = GB / config.dram_bytes_per_s
    assert parked.completion_s[0] == pytest.approx(barrier.completion_s[0] - dram_s, abs=0.2)
    assert parked.used_byte_s < 0.5 * barrier.used_byte_s
    with pytest.raises(ValueError):
        simulate([job], GB, "prefix", replace(config, readers="eager"))


def test_the_command_writes_the_plot(tmp_path: Path, capsys) -> None:
    out = tmp_path / "mux.png"
    assert main(["--out", str(out), "--jobs", "6"]) == 0
    assert out.read_bytes().startswith(b"\x89PNG")
    assert "20% prefix" in capsys.readouterr().out
    assert main(["--out", str(out), "--jobs", "6", "--readers", "park"]) == 0
    assert "readers park" in capsys.readouterr().out
