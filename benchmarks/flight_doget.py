"""DoGet throughput over the Arrow Flight path, server binary against server binary.

One DRAM server per binary (all on loopback, started at once), one object of ``--size-mib`` MiB
put on each by the client core, then a plain ``pyarrow.flight`` client reads the object's blocks
by one DoGet ticket (at least 256 MiB per timing), alternating between the binaries round by round
(and which goes first) so a noisy machine hurts each alike. Prints one JSON line per (binary,
size) with every round's MB/s, the median, the median of each round's ratio to the first, and
the server's CPU seconds (user + system) per GiB sent, which load on the machine disturbs less.

    python3 -m benchmarks.flight_doget --binary before=/path/a --binary after=/path/b \
        --size-mib 64 --size-mib 1 --rounds 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.flight as flight

from benchmarks.machine import process_cpu_s
from benchmarks.peers import standalone_job
from pocketflow.auth import write_secret_file
from pocketflow.client import connect
from pocketflow.handle import JobHandle, ServerInfo
from pocketflow.protocol import OP_LOOKUP, exchange_descriptor, get_ticket
from pocketflow.server_process import ServerSpec, StorageServerProcess
from pocketflow.transport import ServerConnection

CAPACITY_BYTES = 512 * 1024 * 1024
BLOCK_SIZE_BYTES = 16 * 1024 * 1024  # the largest a job allows
TOKEN_TTL_S = 3600.0


def _ticket(handle: JobHandle, key: str) -> tuple[str, bytes]:
    """The address and a DoGet ticket for every block of ``key`` (one server holds them all)."""
    server = handle.servers[0]
    lookup = ServerConnection(server.address,
                              exchange_command=lambda: exchange_descriptor(handle.context()))
    try:
        header = lookup.call(handle.epoch, OP_LOOKUP, 0, b"bench", key.encode()).header
    finally:
        lookup.close()
    assert header is not None
    ranges = []
    for index in range(1, header.block_count + 1):
        start = (index - 1) * header.block_size
        ranges.append((index, 0, min(header.block_size, header.size - start)))
    return server.address, get_ticket(handle.context(), bucket="bench", key=key,
                                      version=header.version, ranges=ranges, delete=False)


def _read(client: flight.FlightClient, ticket: bytes) -> int:
    """Bytes of values received by one DoGet of ``ticket``."""
    got = 0
    for chunk in client.do_get(flight.Ticket(ticket)):
        got += chunk.data.column(0).buffers()[2].size
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", action="append", required=True, help="name=path")
    parser.add_argument("--size-mib", action="append", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="flight-doget-"))
    secret = write_secret_file(workdir / "cluster.secret")
    processes: dict[str, StorageServerProcess] = {}
    handles: dict[str, JobHandle] = {}
    try:
        for named in args.binary:
            name, path = named.split("=", 1)
            os.environ["POCKETFLOW_SERVER_BIN"] = path
            process = StorageServerProcess(ServerSpec(
                node_id=name, tier="dram", capacity_bytes=CAPACITY_BYTES,
                secret_file=workdir / "cluster.secret", threads=2, metrics=False))
            processes[name] = process
            info = ServerInfo(name, process.start(), "dram", 1.0, False)
            handle = standalone_job(info, secret, block_size_bytes=BLOCK_SIZE_BYTES,
                                    ttl_s=TOKEN_TTL_S)
            handles[name] = handle

        for size_mib in args.size_mib:
            size = size_mib * 1024 * 1024
            data = os.urandom(size)
            tickets = {}
            for name, handle in handles.items():
                key = f"obj-{size_mib}"
                with connect(handle) as pf:
                    if size_mib == args.size_mib[0]:
                        pf.create_bucket("bench")
                    pf.put("bench", key, data)
                tickets[name] = _ticket(handle, key)
            rates: dict[str, list[float]] = {name: [] for name in handles}
            cpu_s: dict[str, float] = {name: 0.0 for name in handles}
            repeat = max(1, (256 * 1024 * 1024) // size)  # at least 256 MiB read per timing
            # One client per server, connected and warmed up before timing.
            clients = {name: flight.connect(f"grpc://{address}")
                       for name, (address, _) in tickets.items()}
            try:
                for name, client in clients.items():
                    assert _read(client, tickets[name][1]) == size
                for round_at in range(args.rounds):
                    # Alternate which binary goes first, so neither always runs after the other.
                    order = list(clients.items())
                    for name, client in order if round_at % 2 == 0 else order[::-1]:
                        pid = processes[name].pid
                        cpu_before = process_cpu_s(pid)
                        started = time.perf_counter()
                        for _ in range(repeat):
                            assert _read(client, tickets[name][1]) == size
                        elapsed = time.perf_counter() - started
                        cpu_s[name] += process_cpu_s(pid) - cpu_before
                        rates[name].append(size * repeat / elapsed / 1e6)
            finally:
                for client in clients.values():
                    client.close()
            first = next(iter(rates.values()))
            for name, values in rates.items():
                # Each round's rate over the first binary's in the same round, then the median.
                ratio = statistics.median(v / f for v, f in zip(values, first, strict=True))
                print(json.dumps({"binary": name, "size_mib": size_mib, "rounds": len(values),
                                  "median_mb_s": round(statistics.median(values), 1),
                                  "median_ratio_to_first": round(ratio, 3),
                                  "server_cpu_s_per_gib": round(
                                      cpu_s[name] / (size * repeat * len(values) / 2**30), 3),
                                  "mb_s": [round(v, 1) for v in values]}), flush=True)
    finally:
        for process in processes.values():
            process.stop()


if __name__ == "__main__":
    sys.exit(main())
