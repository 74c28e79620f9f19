"""Tests of the simulator: allocated throughput follows the jobs' demand (real policies)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pocketflow.control.simulator import (
    FIGURE10_TRACE,
    SimConfig,
    SimJob,
    main,
    plot,
    simulate,
)
from pocketflow.control.sizing import SizingBounds
from pocketflow.control.tiers import GB

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def figure10():
    return simulate(FIGURE10_TRACE, SimConfig())


def test_every_job_registers_within_the_start_up_delay_and_runs_its_length(figure10) -> None:
    delay_max = max(figure10.config.startup_delay_s.values())
    for job, spec in zip(figure10.jobs, FIGURE10_TRACE, strict=True):
        assert job.start_s is not None, job
        assert spec.arrive_s <= job.start_s <= spec.arrive_s + delay_max + 1
        assert job.end_s == job.start_s + spec.run_s


def test_allocated_throughput_covers_demand_while_jobs_run(figure10) -> None:
    for sample in figure10.samples:
        assert sample.allocated_bytes_per_s >= sample.demand_bytes_per_s, sample


def test_allocation_grows_with_demand(figure10) -> None:
    baseline = figure10.samples[0].allocated_bytes_per_s
    sort = next(j for j in figure10.jobs if j.name == "sort")
    during = figure10.samples[sort.start_s]
    # The sort job alone needs more than the two long-running DRAM servers offer.
    assert during.demand_bytes_per_s > baseline
    assert during.allocated_bytes_per_s >= during.demand_bytes_per_s
    # Its NVMe servers were launched for it: NVMe servers are up while it runs.
    assert during.nodes_up > figure10.config.long_running_count


def test_allocation_shrinks_back_after_deregistration_within_bounded_steps(figure10) -> None:
    config = figure10.config
    last_end = max(j.end_s for j in figure10.jobs if j.end_s is not None)
    baseline = figure10.samples[0].allocated_bytes_per_s
    extra_nodes = figure10.samples[last_end].nodes_up - config.long_running_count
    # One server drained per cool-down, plus a step for it to exit.
    bound_s = int(extra_nodes * (config.bounds.cooldown_s + 1)) + 2
    assert last_end + bound_s < config.duration_s
    settled = figure10.samples[last_end + bound_s]
    assert settled.allocated_bytes_per_s == baseline
    assert settled.nodes_up == config.long_running_count
    assert all(s.allocated_bytes_per_s == baseline for s in figure10.samples[last_end + bound_s:])


def test_scale_down_releases_every_idle_node_together_within_a_few_steps(figure10) -> None:
    # The last job's servers empty when it deregisters; they go in one action after the
    # short cool-down, not one per cool-down (which took extra nodes x 6 steps before).
    config = figure10.config
    last_end = max(j.end_s for j in figure10.jobs if j.end_s is not None)
    baseline = figure10.samples[0].allocated_bytes_per_s
    bound_s = int(config.bounds.vertical_cooldown_s) + 2
    assert figure10.samples[last_end + bound_s].allocated_bytes_per_s == baseline
    drains = [s.action for s in figure10.samples if s.action.startswith("drain")]
    assert any("," in action for action in drains), drains


def test_allocation_shrinks_between_jobs(figure10) -> None:
    video = next(j for j in figure10.jobs if j.name == "video")
    sort = next(j for j in figure10.jobs if j.name == "sort")
    peak = max(s.allocated_bytes_per_s for s in figure10.samples[: video.end_s])
    later = figure10.samples[sort.end_s + 4].allocated_bytes_per_s
    assert later < peak


def test_a_job_that_fits_registers_at_once_and_launches_nothing() -> None:
    trace = [SimJob("tiny", {"peak_throughput_bytes_per_s": GB // 2}, arrive_s=3, run_s=10)]
    result = simulate(trace, SimConfig(duration_s=30))
    assert result.jobs[0].start_s == 3
    assert all(s.nodes_starting == 0 for s in result.samples)


def test_registration_waits_for_the_start_up_delay() -> None:
    trace = [SimJob("big", {"max_concurrent_tasks": 60}, arrive_s=2, run_s=10)]
    config = SimConfig(startup_delay_s={"dram": 7, "nvme": 12}, duration_s=60)
    result = simulate(trace, config)
    assert result.jobs[0].start_s == 2 + 7  # 4.5 GB/s: three more DRAM servers
    assert result.samples[2].nodes_starting == 3


def test_bounds_change_the_outcome() -> None:
    tight = SimConfig(bounds=SizingBounds(lower=0.1, upper=0.2, cooldown_s=2.0), duration_s=120)
    loose = SimConfig(duration_s=120)
    peak_tight = max(s.allocated_bytes_per_s for s in simulate(FIGURE10_TRACE, tight).samples)
    peak_loose = max(s.allocated_bytes_per_s for s in simulate(FIGURE10_TRACE, loose).samples)
    assert peak_tight > peak_loose


def test_duration_is_bounded() -> None:
    with pytest.raises(ValueError):
        simulate(FIGURE10_TRACE, SimConfig(duration_s=0))


def test_plot_writes_a_png(figure10, tmp_path: Path) -> None:
    out = plot(figure10, tmp_path / "sim.png")
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000


def test_command_line_writes_the_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fig10.png"
    assert main(["--out", str(out), "--duration-s", "160"]) == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert "wrote" in capsys.readouterr().out


def test_hot_servers_get_threads_before_the_cluster_gets_servers(figure10) -> None:
    actions = [s.action for s in figure10.samples if s.action]
    first_add = next(i for i, a in enumerate(actions) if a.startswith("add "))
    assert first_add > 0
    assert all(a.startswith("threads ") for a in actions[:first_add])


def test_capacity_is_sampled_from_each_jobs_arrival_and_covered_once_it_runs(figure10) -> None:
    for job in figure10.jobs:
        asked = figure10.samples[job.arrive_s]
        assert asked.demand_capacity_bytes >= job.demand.capacity_bytes
    for sample in figure10.samples:
        running = [j for j in figure10.jobs
                   if j.start_s is not None and j.start_s <= sample.t_s
                   and (j.end_s is None or sample.t_s < j.end_s)]
        waiting = [j for j in figure10.jobs if j.arrive_s <= sample.t_s and (
            j.start_s is None or sample.t_s < j.start_s)]
        if running and not waiting:
            assert sample.allocated_capacity_bytes >= sample.demand_capacity_bytes, sample


def test_the_sizing_policy_runs_every_sizing_interval() -> None:
    config = SimConfig(sizing_interval_s=5, duration_s=150)
    result = simulate(FIGURE10_TRACE, config)
    sized = [s.t_s for s in result.samples if s.action]
    assert sized and all(t % 5 == 0 for t in sized), sized
    with pytest.raises(ValueError):
        SimConfig(sizing_interval_s=0)


def test_a_reservation_met_at_registration_and_half_written_launches_no_more_nodes() -> None:
    """The trace's jobs write half their data size: a job reserving 87.5% of DRAM gets the
    servers it needs at registration and the sizing loop launches none for the unwritten
    half (it launched two in the real trace); a job that writes all of it grows the tier."""
    from pocketflow.control.tiers import local_spec

    mib = 1024 * 1024
    config = SimConfig(
        spec=local_spec(dram_capacity_bytes=16 * mib),
        bounds=SizingBounds(cooldown_s=2.0, vertical_cooldown_s=1.0),
        startup_delay_s={"dram": 3},
        duration_s=40,
    )
    hints = {"latency_sensitive": True, "data_size_bytes": 28 * mib,
             "peak_throughput_bytes_per_s": 1_000_000}

    def added(written_fraction: float) -> list[str]:
        trace = [SimJob("half", hints, arrive_s=1, run_s=30,
                        written_fraction=written_fraction, write_s=10)]
        result = simulate(trace, config)
        assert result.jobs[0].start_s == 1, "the job fits the two long-running servers"
        return [s.action for s in result.samples if s.action.startswith("add")]

    assert added(0.5) == []
    assert added(1.0), "a tier filled by data grows"


def test_written_fraction_is_validated() -> None:
    with pytest.raises(ValueError):
        SimJob("bad", {}, arrive_s=0, run_s=1, written_fraction=1.5)
    with pytest.raises(ValueError):
        SimJob("bad", {}, arrive_s=0, run_s=1, write_s=-1)
