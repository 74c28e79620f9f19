"""``benchmarks/sort_scale.py`` at a tiny size on the session cluster: every variant sorts the
same records and validates (Ray Data's only where ``ray.data`` imports; otherwise it says why it
was skipped), pocketflow's runs carry their tiers' timeline, and the report, its goals and its
plot are written. It checks the script works, not how fast anything is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pocketflow
from benchmarks.machine import scan_processes
from benchmarks.sort_scale import (
    VARIANTS,
    busy_shares,
    device_stat_path,
    process_cpu,
    process_group,
    report,
    run_sizes,
    sort_config,
    tasks_in_flight,
    wait_for_settled_usage,
    write,
)
from pocketflow.cluster import LocalCluster

TINY_BYTES = 2_000_000
"""Input of the tiny sort: 20,000 records."""
MiB = 1024 * 1024


def test_the_sort_benchmark_runs_every_variant_at_a_tiny_size(
    local_cluster: LocalCluster, tmp_path: Path,
) -> None:
    runs = run_sizes(local_cluster, [TINY_BYTES], VARIANTS, redis_max_bytes=64 * MiB)
    by_variant = {r.variant: r for r in runs}
    assert set(by_variant) == set(VARIANTS)
    for variant in ("pocketflow-ray", "pocketflow-lithops", "lithops-localhost",
                    "lithops-redis"):
        done = by_variant[variant]
        assert done.ok and not done.skipped, (variant, done.problems)
        assert done.job_s > 0 and done.gb_per_s > 0, variant
    # The tiny sort's job fits in DRAM: no variant runs more than the cores' tasks at once.
    assert {r.tasks_max for r in runs} == {2}
    ray_data = by_variant["ray-data"]
    assert ray_data.ok or "ray.data" in ray_data.skipped, (ray_data.problems, ray_data.skipped)
    for variant in ("pocketflow-ray", "pocketflow-lithops"):
        done = by_variant[variant]
        # The data went through the DRAM servers, seen by the sampler (peak and timeline).
        assert done.timeline and done.peak_dram_bytes > 0, variant
        assert done.peak_server_rss_bytes > 0, variant
        assert {"map", "shuffle_writes_per_mapper", "reads_per_reducer",
                "validate"} <= done.phase_s.keys(), variant
        # Busy times per phase: the machine's CPU always, the device where the cluster's work
        # directory (the NVMe server's file) is on one.
        assert done.busy["all"]["wall_s"] > 0 and done.busy["all"]["cpu_busy_s"] > 0, variant
        if device_stat_path(local_cluster.work_dir) is not None:
            assert done.busy["all"]["device_busy_s"] >= 0, variant
    results = report(runs, [TINY_BYTES], VARIANTS, cluster_shape={"session": True},
                     redis_max_bytes=64 * MiB, started_iso="now", duration_s=1.0)
    assert "speedup_vs_fastest_peer" in results["summary"][str(TINY_BYTES)]
    written = write(results, runs, tmp_path)
    assert json.loads(written.read_text())["summary"] == json.loads(json.dumps(
        results["summary"]))
    assert "Goals:" in written.with_suffix(".md").read_text()
    assert "Machine-wide busy time" in written.with_suffix(".md").read_text()
    # This process's children ran the tasks and served the bytes: their CPU is in the run's
    # per-process table, by group.
    for variant in ("pocketflow-ray", "pocketflow-lithops"):
        groups = by_variant[variant].process_cpu["all"]
        assert groups["driver"]["user_s"] + groups["driver"]["system_s"] > 0, variant
        # The servers' user and system times count in 10 ms ticks, which a tiny sort's few ms
        # of server work can round to 0; main_cpu_s is in ns.
        assert sum(g["user_s"] + g["system_s"] + g["main_cpu_s"] for name, g in groups.items()
                   if name.endswith(" servers")) > 0, (variant, groups)
    assert by_variant["pocketflow-ray"].process_cpu["all"]["task workers"]["main_cpu_s"] > 0
    assert "by the run's processes" in written.with_suffix(".md").read_text()
    assert written.with_suffix(".png").stat().st_size > 0


def test_busy_shares_split_the_machines_busy_time_at_the_map_phases_end() -> None:
    samples = [{"t_s": 0.0, "device_busy_s": 10.0, "cpu_busy_s": 100.0},
               {"t_s": 2.0, "device_busy_s": 11.0, "cpu_busy_s": 103.0},
               {"t_s": 4.0, "device_busy_s": 13.0, "cpu_busy_s": 104.0}]
    shares = busy_shares(samples, 1.0)
    assert shares["before"] == {"wall_s": 1.0, "device_busy_s": 0.5, "cpu_busy_s": 1.5}
    assert shares["after"] == {"wall_s": 3.0, "device_busy_s": 2.5, "cpu_busy_s": 2.5}
    assert shares["all"] == {"wall_s": 4.0, "device_busy_s": 3.0, "cpu_busy_s": 4.0}
    # A counter some sample lacks (no block device under the work directory) is left out.
    samples[1]["device_busy_s"] = None
    assert "device_busy_s" not in busy_shares(samples, 1.0)["all"]
    assert device_stat_path(Path("/nonexistent/path")) is None


def test_a_sort_whose_job_is_on_nvme_gives_every_variant_the_same_extra_tasks(
    local_cluster: LocalCluster,
) -> None:
    # 480 MiB of input (the shuffle reserves its input's size: DELETE reads free the inputs for
    # the outputs): the session cluster's DRAM (2 x 128 MiB) holds about half, so much of the
    # job's weight is on its NVMe server (256 MiB). With 2 extra slots asked for,
    # pocketflow-ray then runs reducers in them, and the Lithops variants get 2 more worker
    # processes; without, or for a job in DRAM, every variant gets the cores' 2.
    assert tasks_in_flight(local_cluster, sort_config(480 * MiB), 2) == 4
    assert tasks_in_flight(local_cluster, sort_config(480 * MiB), 0) == 2
    assert tasks_in_flight(local_cluster, sort_config(TINY_BYTES), 2) == 2


def test_process_cpu_splits_each_groups_cpu_at_the_map_phases_end() -> None:
    # Two samples 2 s apart and one more at 4 s: a server there from the start, a worker that
    # starts after the first sample (counted from zero there) and one that is gone at the end
    # (it keeps its last reading).
    samples = [
        {"t_s": 0.0, "procs": {10: ["dram servers", 1.0, 2.0, 100, 0.0, 0.0, 0.0],
                               30: ["task workers", 5.0, 0.0, 0, 5.0, 1.0, 1.0]}},
        {"t_s": 2.0, "procs": {10: ["dram servers", 2.0, 2.0, 300, 0.0, 0.0, 0.0],
                               20: ["task workers", 1.0, 1.0, 50, 1.0, 0.5, 0.5],
                               30: ["task workers", 6.0, 0.0, 0, 6.0, 1.0, 1.0]}},
        {"t_s": 4.0, "procs": {10: ["dram servers", 4.0, 3.0, 300, 0.0, 0.0, 0.0],
                               20: ["task workers", 3.0, 1.0, 50, 3.0, 0.5, 0.5],
                               40: ["other", 0.5, 0.0, 0, 0.5, 0.0, 0.0]}},
        # A Ray worker first seen unnamed counts in the group it names itself into.
        {"t_s": 4.0, "procs": {40: ["actors", 0.5, 0.0, 0, 0.5, 0.0, 0.0]}},
    ]
    cpu = process_cpu(samples, 2.0)
    assert cpu["before"]["dram servers"] == {"user_s": 1.0, "system_s": 0.0,
                                             "minor_faults": 200.0, "main_cpu_s": 0.0,
                                             "run_delay_s": 0.0, "threads_run_delay_s": 0.0}
    assert cpu["after"]["dram servers"]["user_s"] == 2.0
    assert cpu["before"]["task workers"]["user_s"] == 2.0  # 1 s each
    assert cpu["after"]["task workers"]["user_s"] == 2.0   # the live one's 2 s
    assert cpu["all"]["task workers"]["run_delay_s"] == 0.5
    assert cpu["all"]["task workers"]["threads_run_delay_s"] == 0.5
    assert cpu["after"]["actors"]["user_s"] == 0.5 and "other" not in cpu["after"]
    assert process_cpu(samples[:1], 1.0) == {}
    servers = {7: "nvme"}
    assert process_group(7, "/x/pocketflow-server --tier nvme", servers=servers,
                         driver=1) == "nvme servers"
    assert process_group(1, "python -m benchmarks.sort_scale", servers=servers,
                         driver=1) == "driver"
    assert process_group(8, "ray::run_calls", servers=servers, driver=1) == "task workers"
    assert process_group(8, "ray::IDLE", servers=servers, driver=1) == "task workers"
    assert process_group(8, "ray::StorageNode.start", servers=servers, driver=1) == "actors"
    assert process_group(8, "ray::RuntimeEnvAgent", servers=servers, driver=1) == "other"
    assert process_group(8, "python /x/ray/_private/workers/default_worker.py --a",
                         servers=servers, driver=1) == "task workers"
    assert process_group(8, "/x/ray/core/src/ray/raylet/raylet --a", servers=servers,
                         driver=1) == "raylet"


def test_the_sort_is_shaped_like_the_issues_demo() -> None:
    # 32 MiB per mapper and half as many reducers (the issue's 1 GB demo ran 32 x 16): 1 GB is
    # 29 x 14, and 10 GB stays within the shuffle's bound on tasks per stage.
    one = sort_config(1_000_000_000)
    assert (one.mappers, one.reducers, one.records) == (29, 14, 10_000_000)
    ten = sort_config(10_000_000_000)
    assert ten.records == 100_000_000 and 2 * ten.reducers <= ten.mappers <= 4096
    assert sort_config(TINY_BYTES).mappers == 2
    # Shaped by object size instead: objects of about 2 MiB at every size, the mappers growing
    # as the square root of the input (1 GB: 30 x 15, close to the demo's 32 x 16).
    for size, shape in ((1_000_000_000, (30, 15)), (10_000_000_000, (97, 48))):
        config = sort_config(size, object_bytes=2 * MiB)
        assert (config.mappers, config.reducers) == shape
        assert 1.9 * MiB < size / (config.mappers * config.reducers) < 2.3 * MiB


def test_a_run_registers_once_the_control_plane_sees_the_previous_runs_bytes_freed(
    local_cluster: LocalCluster,
) -> None:
    # A run's outputs are deleted just before the next run registers; the control plane packs
    # the new job on the bytes its latest heartbeats say are used, so without the wait the
    # next job saw 96 MiB of the DRAM tier still taken and got a smaller DRAM share.
    from pocketflow_lithops.shuffle import shuffle_data_bytes, shuffle_hints

    dram = [s.node_id for s in local_cluster.servers if s.tier == "dram"]
    assert wait_for_settled_usage(local_cluster)
    baseline = {row["node_id"]: row["used_bytes"] for row in local_cluster.status()["servers"]}
    dram_free = sum(s.capacity_bytes - baseline[s.node_id]
                    for s in local_cluster.servers if s.tier == "dram")
    # As a run does: its job ends, its PERSIST outputs outlive it and are then deleted.
    with local_cluster.register_job("previous-run", {"data_size_bytes": 96 * MiB}) as job:
        with job.connect() as pf:
            pf.create_bucket("outputs")
            for i in range(48):
                pf.put("outputs", f"o{i:03d}", bytes(2 * MiB), persist=True)
        handle_json = job.handle.to_json()
    assert wait_for_settled_usage(local_cluster)
    with pocketflow.connect(handle_json) as pf:
        for i in range(48):
            pf.delete("outputs", f"o{i:03d}")
    assert wait_for_settled_usage(local_cluster)
    # A job that fits the DRAM the servers have free, whole, once the freed bytes are seen.
    hints = shuffle_hints(8, 4, shuffle_data_bytes(dram_free - 24 * MiB, persist_output=True,
                                                   delete_inputs=True))
    with local_cluster.register_job("next-run", hints) as job:
        weights = {s.node_id: s.weight for s in job.handle.servers}
    assert sum(weights[n] for n in dram) > 0.99, weights


def test_one_proc_scan_finds_the_tree_below_its_root_with_its_cpu_and_rss() -> None:
    # A child that spins on a core for a while, then starts a grandchild and waits on it.
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         "end = time.process_time() + 0.3\n"
         "while time.process_time() < end: pass\n"
         "block = bytearray(64 << 20)\n"
         "subprocess.run(['sleep', '30'])\n"],
        stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            scan = scan_processes(os.getpid())
            below = [pid for pid, command in scan.commands.items() if command == "sleep 30"]
            if below or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert below, scan.commands
        assert child.pid in scan.commands and os.getpid() in scan.commands
        user_s, system_s, minor_faults, main_cpu_s, _delay, _threads_delay = scan.times[child.pid]
        assert user_s + system_s >= 0.2 and main_cpu_s >= 0.2 and minor_faults > 0
        # Its 64 MiB block is resident: the scan's figure is the one /proc/<pid>/status shows.
        status = Path(f"/proc/{child.pid}/status").read_text()
        vm_rss = next(int(line.split()[1]) * 1024 for line in status.splitlines()
                      if line.startswith("VmRSS:"))
        assert scan.rss_bytes[child.pid] >= 64 << 20
        assert abs(scan.rss_bytes[child.pid] - vm_rss) <= 1 << 20
        assert scan.kernel_threads_s >= 0
        # Nothing outside the tree: pid 1 is not below this process.
        assert 1 not in scan.commands
    finally:
        for pid in scan.commands:
            if scan.commands[pid] == "sleep 30":
                os.kill(pid, 9)
        child.kill()
        child.wait(timeout=10)
