"""Example: a MapReduce sort on Lithops whose shuffle goes through pocketflow.

Run with ``python3 examples/sort.py``. It starts an embedded local cluster, then sorts generated
100-byte records (10-byte keys) with 4 mappers and 2 reducers on Lithops' localhost executor,
driven by :func:`pocketflow_lithops.sort.run_sort`. The drop-in shuffle
(:func:`pocketflow_lithops.shuffle.shuffle`, documented in ``adapters/lithops``) registers a
pocketflow job with hints, writes one object per (mapper, reducer), lets reducers wait for their
inputs on the storage servers and read them with DELETE, writes the sorted partitions with
PERSIST and deregisters the job. The output is then read back and validated: globally sorted,
complete, same checksum as the input.
``pocketflow demo`` is the same job with more options.
"""

import sys

import lithops
from pocketflow_lithops.sort import run_sort

import pocketflow
from pocketflow.demo import SortConfig, forget_inherited_lithops_session, lithops_config


def main() -> int:
    """Start a local cluster, run the sort on Lithops, print the report."""
    config = SortConfig(mappers=4, reducers=2, records=200_000)
    forget_inherited_lithops_session()
    with pocketflow.LocalCluster(num_cpus=2) as cluster:
        # The executor's own storage (payloads, results) is Lithops' localhost storage; the
        # shuffle's data goes to pocketflow.
        with lithops.FunctionExecutor(
            config=lithops_config(storage="localhost", workers=2)
        ) as fexec:
            try:
                report = run_sort(cluster, config, fexec=fexec)
            finally:
                fexec.clean()
    print("\n".join(report.summary_lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
