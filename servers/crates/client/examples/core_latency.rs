//! Latency of the client core's calls against a DRAM server in this process (no Python):
//! `cargo run --release -p pocketflow-client --example core_latency`.

use std::time::{Duration, Instant};

use bytes::Bytes;
use pocketflow_client::{
    block_on, BlockSlice, Connection, ConnectionConfig, ExchangeRequest, RangeTarget,
};
use pocketflow_flight::{ServiceConfig, StorageService};
use pocketflow_protocol::frame::OpCode;
use pocketflow_protocol::header::ObjectHeader;
use pocketflow_protocol::limits::ADMIN_JOB_ID;
use pocketflow_protocol::token::{now_unix_ms, TokenKey};
use pocketflow_store::{Store, StoreConfig, Tier};

const SECRET: &[u8] = b"a benchmark secret of enough bytes";
const JOB: &str = "job-core-latency";

fn start_server() -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().expect("server runtime");
        runtime.block_on(async move {
            let store = Store::open(StoreConfig {
                tier: Tier::Dram,
                capacity_bytes: 512 << 20,
                nvme_path: None,
                long_running: true,
                persist_ttl: None,
                shared_dram: false,
            })
            .expect("store");
            let service = StorageService::new(
                store,
                ServiceConfig {
                    node_id: "dram-bench".into(),
                    token_key: TokenKey::new(SECRET).expect("key"),
                    transfer_idle: Duration::from_secs(30),
                },
            );
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap().to_string()).unwrap();
            tonic::transport::Server::builder()
                .tcp_nodelay(true)
                .initial_stream_window_size(8 << 20)
                .initial_connection_window_size(16 << 20)
                .max_frame_size(1 << 20)
                .add_service(service.into_server())
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
    });
    rx.recv().expect("server address")
}

fn p50(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn main() {
    let address = start_server();
    let conn = Connection::new(&address, ConnectionConfig::default()).unwrap();
    let token = TokenKey::new(SECRET)
        .unwrap()
        .make(JOB, now_unix_ms() + 600_000);
    let ctx = serde_json::json!({"job": JOB, "epoch": 1, "token": token});
    // Register the job as the control plane does: only a registered job writes.
    let admin = TokenKey::new(SECRET)
        .unwrap()
        .make(ADMIN_JOB_ID, now_unix_ms() + 600_000);
    let register = serde_json::json!({
        "ctx": {"job": ADMIN_JOB_ID, "epoch": 0, "token": admin},
        "job": JOB, "epoch": 1, "map": {"epoch": 1},
    });
    block_on(conn.action("set_epoch", Bytes::from(register.to_string()))).unwrap();
    let body = serde_json::json!({"ctx": ctx, "bucket": "b"});
    block_on(conn.action("create_bucket", Bytes::from(body.to_string()))).unwrap();
    let command = Bytes::from(serde_json::json!({ "ctx": ctx }).to_string());
    let value = Bytes::from(vec![7u8; 1024]);
    let put = |key: String| ExchangeRequest {
        op: OpCode::Put,
        flags: 0,
        bucket: "b".into(),
        key,
        header: ObjectHeader {
            version: 1,
            size: 1024,
            ..Default::default()
        },
        value: value.clone(),
    };
    let mut samples = Vec::new();
    for i in 0..3000 {
        let started = Instant::now();
        block_on(conn.exchange(&command, 1, &[put(format!("k{i}"))], 1)).unwrap();
        samples.push(started.elapsed());
    }
    println!("1 KiB put p50 {:?}", p50(samples));
    let get = ExchangeRequest {
        op: OpCode::Get,
        flags: 0,
        bucket: "b".into(),
        key: "k1".into(),
        header: ObjectHeader::default(),
        value: Bytes::new(),
    };
    let mut samples = Vec::new();
    for _ in 0..3000 {
        let started = Instant::now();
        block_on(conn.exchange(&command, 1, std::slice::from_ref(&get), 1)).unwrap();
        samples.push(started.elapsed());
    }
    println!("1 KiB get p50 {:?}", p50(samples));

    let block = vec![3u8; 1 << 20];
    let mut samples = Vec::new();
    for version in 1..200u64 {
        let descriptor = serde_json::json!({"ctx": ctx, "bucket": "b", "key": "big",
            "version": version, "block_size": 1 << 20, "persist": false});
        let started = Instant::now();
        block_on(conn.put_blocks(
            Bytes::from(descriptor.to_string()),
            &[BlockSlice {
                index: 1,
                data: &block,
            }],
        ))
        .unwrap();
        samples.push(started.elapsed());
    }
    println!("1 MiB DoPut p50 {:?}", p50(samples));
    let ticket = Bytes::from(
        serde_json::json!({"ctx": ctx, "bucket": "b", "key": "big", "version": 7,
            "ranges": [[1, 0, 1 << 20]], "delete": false})
        .to_string(),
    );
    let ranges = [RangeTarget {
        block: 1,
        offset: 0,
        len: 1 << 20,
        dest_at: 0,
    }];
    let mut dest = vec![0u8; 1 << 20];
    let mut samples = Vec::new();
    let rounds: usize = std::env::var("DOGET_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    for _ in 0..rounds {
        let started = Instant::now();
        let outcome =
            block_on(conn.get_ranges(ticket.clone(), &ranges, &mut [&mut dest[..]])).unwrap();
        assert!(outcome.error.is_none());
        samples.push(started.elapsed());
    }
    println!("1 MiB DoGet p50 {:?}", p50(samples));
}
