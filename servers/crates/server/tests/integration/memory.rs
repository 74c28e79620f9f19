//! The memory bound of docs/PROTOCOL.md: under concurrent block transfers and busy sessions the
//! server's peak resident memory stays within its capacity plus the documented overhead.

use bytes::Bytes;
use pocketflow_flight::bounds::{
    BASE_OVERHEAD_BYTES, HTTP2_CONNECTION_WINDOW_BYTES, SESSION_BUFFER_BYTES, TRANSFER_BUFFER_BYTES,
};
use pocketflow_protocol::frame::{OpCode, OP_FLAG_DELETE};
use serde_json::json;

use crate::harness::*;

const MIB: usize = 1 << 20;
const TRANSFER_CLIENTS: usize = 6;
const SESSION_CLIENTS: usize = 2;
const ROUNDS: u64 = 3;

async fn transfer_load(server_addr: String, worker: u64) {
    let client = Client::connect(&server_addr).await;
    for round in 0..ROUNDS {
        let version = worker * 100 + round + 1;
        let key = format!("w{worker}");
        let blocks: Vec<(u32, Bytes)> = (1..=2)
            .map(|i| (i, pattern(4 * MIB, version + i as u64)))
            .collect();
        let descriptor = put_descriptor("job-m", "b", &key, version, 4 * MIB as u32, false);
        if client
            .put_blocks(descriptor, &blocks, 4 * MIB)
            .await
            .is_err()
        {
            continue; // capacity_exhausted under contention is allowed; the bound is what is tested
        }
        let ticket = json!({"ctx": ctx("job-m", 1), "bucket": "b", "key": key, "version": version,
                            "ranges": [[1, 0, 4 * MIB], [2, 0, 4 * MIB]], "delete": true});
        let pieces = client.get_ranges(ticket).await.expect("read back");
        assert_eq!(pieces.iter().map(|(_, b)| b.len()).sum::<usize>(), 8 * MIB);
    }
}

async fn session_load(server_addr: String, worker: u64) {
    let client = Client::connect(&server_addr).await;
    let mut session = client.session("job-m", 1).await.unwrap();
    for round in 0..ROUNDS {
        let base = (worker * 10 + round) * 1000;
        let puts: Vec<_> = (0..256)
            .map(|i| {
                put(
                    base + i,
                    "s",
                    &format!("k{}", base + i),
                    pattern(16 * 1024, i),
                    0,
                )
            })
            .collect();
        session.run(1, &puts).await;
        let gets: Vec<_> = (0..256)
            .map(|i| {
                simple(
                    base + i,
                    OpCode::Get,
                    "s",
                    &format!("k{}", base + i),
                    OP_FLAG_DELETE,
                )
            })
            .collect();
        session.run(1, &gets).await;
    }
}

#[tokio::test]
async fn resident_memory_stays_within_capacity_plus_overhead() {
    let capacity_bytes = 96 * MIB;
    let server = TestServer::start(ServerOptions {
        capacity: format!("{capacity_bytes}"),
        ..Default::default()
    });
    let client = server.client().await;
    client.create_bucket("job-m", "b").await;
    client.create_bucket("job-m", "s").await;
    let (idle_rss, _) = server.memory_bytes();

    let mut tasks = Vec::new();
    for worker in 0..TRANSFER_CLIENTS as u64 {
        tasks.push(tokio::spawn(transfer_load(server.addr.clone(), worker)));
    }
    for worker in 0..SESSION_CLIENTS as u64 {
        tasks.push(tokio::spawn(session_load(server.addr.clone(), worker)));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let (rss, peak) = server.memory_bytes();

    // The documented bound, instantiated for this load: every connection's window, every
    // transfer's and session's buffers, on top of the capacity and the fixed base.
    let connections = TRANSFER_CLIENTS + SESSION_CLIENTS + 1;
    let bound = capacity_bytes
        + BASE_OVERHEAD_BYTES
        + connections * HTTP2_CONNECTION_WINDOW_BYTES as usize
        + TRANSFER_CLIENTS * TRANSFER_BUFFER_BYTES
        + SESSION_CLIENTS * SESSION_BUFFER_BYTES;
    eprintln!(
        "memory: idle {} MiB, after {} MiB, peak {} MiB, bound {} MiB (capacity {} MiB)",
        idle_rss >> 20,
        rss >> 20,
        peak >> 20,
        bound >> 20,
        capacity_bytes >> 20
    );
    assert!(
        peak as usize <= bound,
        "peak RSS {peak} exceeds the bound {bound}"
    );
    assert!(
        idle_rss as usize <= capacity_bytes + BASE_OVERHEAD_BYTES,
        "idle RSS {idle_rss}"
    );
}
