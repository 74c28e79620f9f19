//! PERSIST objects expire after the server's `--persist-ttl`; `set_cores` changes the CPU cores
//! a running server uses without losing its data.

use std::time::{Duration, Instant};

use bytes::Bytes;
use pocketflow_protocol::frame::{OpCode, OP_FLAG_PERSIST};
use serde_json::json;
use tonic::Code;

use crate::harness::*;

/// CPU ids each thread of `pid` may run on, from `/proc/<pid>/task/*/status`.
fn thread_cpus(pid: i32) -> Vec<String> {
    let mut lists = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task")).expect("task dir") {
        let status = std::fs::read_to_string(entry.unwrap().path().join("status"));
        let Ok(status) = status else { continue };
        let line = status
            .lines()
            .find(|l| l.starts_with("Cpus_allowed_list:"))
            .expect("Cpus_allowed_list");
        lists.push(line.split(':').nth(1).unwrap().trim().to_owned());
    }
    lists
}

#[tokio::test]
async fn persist_objects_outlive_their_job_and_expire_after_the_ttl() {
    let server = TestServer::start(ServerOptions {
        long_running: true,
        persist_ttl: Some("2s".into()),
        ..Default::default()
    });
    let client = server.client().await;
    let stats = client.stats().await;
    assert_eq!(stats["persist_ttl_ms"], 2000);
    let baseline = stats["used_bytes"].as_u64().unwrap();
    client.create_bucket("job-a", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    let written = Instant::now();
    put_kept_and_gone_then_delete_job(&client, &mut session, 4096).await;
    // After the job is gone, its PERSIST object is still readable (well inside the TTL).
    let replies = session
        .run(1, &[simple(3, OpCode::Get, "b", "kept", 0)])
        .await;
    assert_eq!(replies[&3].status, 0);
    assert!(written.elapsed() < Duration::from_millis(1500));
    assert!(client.stats().await["used_bytes"].as_u64().unwrap() > baseline);

    // The sweeper frees it (record and data block) within the TTL plus a few sweeps.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let used = client.stats().await["used_bytes"].as_u64().unwrap();
        if used == baseline {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "PERSIST data not expired: {used} bytes"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(written.elapsed() >= Duration::from_secs(2));
    let stats = client.stats().await;
    assert_eq!(stats["objects"], 0);
    assert!(stats["jobs"].as_object().unwrap().is_empty(), "{stats}");
}

#[tokio::test]
async fn without_a_ttl_persist_objects_stay() {
    let server = TestServer::start(ServerOptions {
        long_running: true,
        ..Default::default()
    });
    let client = server.client().await;
    assert_eq!(client.stats().await["persist_ttl_ms"], 0);
    client.create_bucket("job-a", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    let replies = session
        .run(
            1,
            &[put(
                1,
                "b",
                "kept",
                Bytes::from_static(b"p"),
                OP_FLAG_PERSIST,
            )],
        )
        .await;
    assert_eq!(replies[&1].status, 0);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(client.stats().await["objects"], 1);
}

#[tokio::test]
async fn set_cores_limits_every_thread_and_keeps_the_data() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    let stats = client.stats().await;
    let max = stats["cores_max"].as_u64().unwrap();
    assert_eq!(stats["cores"], max);
    assert_eq!(stats["threads"], 2);
    client.create_bucket("job-a", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    let replies = session
        .run(1, &[put(1, "b", "k", Bytes::from_static(b"value"), 0)])
        .await;
    assert_eq!(replies[&1].status, 0);
    let all_cpus = thread_cpus(server.pid());

    let result = client
        .action("set_cores", json!({"ctx": admin_ctx(), "cores": 1}))
        .await
        .unwrap();
    assert_eq!(result, json!({"cores": 1, "cores_max": max}));
    let limited = thread_cpus(server.pid());
    assert!(limited.len() >= 3, "{limited:?}");
    let first = limited[0].clone();
    assert!(!first.contains(',') && !first.contains('-'), "{first}");
    assert!(limited.iter().all(|cpus| *cpus == first), "{limited:?}");
    assert_eq!(client.stats().await["cores"], 1);
    // The data survived and the server still serves.
    let replies = session.run(1, &[simple(2, OpCode::Get, "b", "k", 0)]).await;
    assert_eq!(replies[&2].status, 0);
    assert_eq!(replies[&2].body, Bytes::from_static(b"value"));

    for bad in [json!(0), json!(max + 1), json!(-1), json!("two")] {
        let err = client
            .action("set_cores", json!({"ctx": admin_ctx(), "cores": bad}))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{bad}: {err}");
    }
    let err = client
        .action("set_cores", json!({"ctx": ctx("job-a", 1), "cores": 1}))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied);

    client
        .action("set_cores", json!({"ctx": admin_ctx(), "cores": max}))
        .await
        .unwrap();
    assert_eq!(thread_cpus(server.pid()), all_cpus);
    assert_eq!(client.stats().await["cores"], max);
}
