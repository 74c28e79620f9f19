"""Example: a MapReduce sort shuffled through pocketflow on an embedded local cluster.

Run with ``python3 examples/sort.py``; ``pocketflow demo`` is the same job with more options.
The tasks themselves live in :mod:`pocketflow.demo` (they must be importable by the worker
processes, which are started with ``spawn``).
"""

import pocketflow
from pocketflow.demo import SortConfig, run_sort


def main() -> None:
    """Start a local cluster, register a job with hints, run the sort, print the report."""
    config = SortConfig(mappers=4, reducers=2, records=200_000)
    hints = pocketflow.Hints(data_size_bytes=2 * config.input_bytes)
    with pocketflow.LocalCluster() as cluster:
        with cluster.register_job("sort-example", hints) as job:
            report = run_sort(job, config)
    print("\n".join(report.summary_lines()))


if __name__ == "__main__":
    main()
