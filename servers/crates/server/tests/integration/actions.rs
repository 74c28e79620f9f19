//! DoAction and auth: tokens, isolation, enumerate paging, deletes, stats, drain, list_actions and
//! the RPCs outside the protocol.

use std::time::Duration;

use arrow_flight::{Criteria, Empty, FlightDescriptor, Ticket};
use bytes::Bytes;
use futures::StreamExt;
use pocketflow_protocol::frame::{OpCode, OP_FLAG_OVERWRITE, OP_FLAG_PERSIST};
use pocketflow_protocol::limits::ADMIN_JOB_ID;
use pocketflow_protocol::token::{now_unix_ms, TokenKey};
use serde_json::json;
use tonic::Code;

use crate::harness::*;

#[tokio::test]
async fn tokens_are_checked_on_every_rpc() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let expired = TokenKey::new(SECRET)
        .unwrap()
        .make("job-a", now_unix_ms() - 1);
    let wrong_secret = TokenKey::new(b"some-other-secret-value")
        .unwrap()
        .make("job-a", now_unix_ms() + 60_000);
    let bad_contexts = [
        json!({"job": "job-a", "epoch": 0, "token": ""}),
        json!({"job": "job-a", "epoch": 0}),
        json!({"job": "job-a", "epoch": 0, "token": "garbage"}),
        json!({"job": "job-a", "epoch": 0, "token": token("job-b")}),
        json!({"job": "job-a", "epoch": 0, "token": expired}),
        json!({"job": "job-a", "epoch": 0, "token": wrong_secret}),
    ];
    for bad in bad_contexts {
        let status = client
            .action("lookup", json!({"ctx": bad, "bucket": "b", "key": "k"}))
            .await
            .unwrap_err();
        assert_eq!(
            (status.code(), status_kind(&status)),
            (Code::PermissionDenied, "permission_denied".into())
        );
        let status = Session::open(&client, json!({"ctx": bad}).to_string().into(), None)
            .await
            .err()
            .unwrap();
        assert_eq!(status.code(), Code::PermissionDenied);
        let mut descriptor = put_descriptor("job-a", "b", "k", 1, 1024, false);
        descriptor["ctx"] = bad.clone();
        let status = client
            .put_blocks(descriptor, &[(1, pattern(10, 1))], 10)
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied);
        let ticket =
            json!({"ctx": bad, "bucket": "b", "key": "k", "version": 1, "ranges": [[1, 0, 1]]});
        let status = client.get_ranges(ticket).await.unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied);
    }
    // Control-plane actions need the admin token; the admin token reaches no job's data.
    for (name, body) in [
        ("stats", json!({"ctx": ctx("job-a", 1)})),
        ("drain", json!({"ctx": ctx("job-a", 1)})),
        (
            "set_epoch",
            json!({"ctx": ctx("job-a", 1), "job": "job-a", "epoch": 9, "map": {}}),
        ),
        (
            "lookup",
            json!({"ctx": admin_ctx(), "bucket": "b", "key": "k"}),
        ),
    ] {
        let status = client.action(name, body).await.unwrap_err();
        assert_eq!(status.code(), Code::PermissionDenied, "{name}");
    }
    let fake_admin = json!({"job": ADMIN_JOB_ID, "epoch": 0, "token": token("job-a")});
    assert_eq!(
        client
            .action("stats", json!({"ctx": fake_admin}))
            .await
            .unwrap_err()
            .code(),
        Code::PermissionDenied
    );
}

#[tokio::test]
async fn jobs_are_isolated_and_enumerate_pages() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    client.create_bucket("job-b", "b").await;
    let status = client
        .action(
            "create_bucket",
            json!({"ctx": ctx("job-a", 1), "bucket": "b"}),
        )
        .await
        .unwrap_err();
    assert_eq!(
        (status.code(), status_kind(&status)),
        (Code::AlreadyExists, "bucket_exists".into())
    );
    let mut session = client.session("job-a", 1).await.unwrap();
    let mut ops: Vec<_> = (0..25)
        .map(|i| put(i, "b", &format!("p/{i:02}"), pattern(10 + i as usize, i), 0))
        .collect();
    ops.extend((25..30).map(|i| put(i, "b", &format!("q/{i}"), pattern(5, i), 0)));
    assert!(session.run(1, &ops).await.values().all(|r| r.status == 0));

    let mut keys = Vec::new();
    let mut start_after: Option<String> = None;
    let mut pages = 0;
    loop {
        let mut body = json!({"ctx": ctx("job-a", 1), "bucket": "b", "prefix": "p/", "limit": 10});
        if let Some(after) = &start_after {
            body["start_after"] = json!(after);
        }
        let page = client.action("enumerate", body).await.unwrap();
        pages += 1;
        let entries = page["keys"].as_array().unwrap();
        for entry in entries {
            keys.push((
                entry["key"].as_str().unwrap().to_owned(),
                entry["size"].as_u64().unwrap(),
            ));
        }
        if !page["truncated"].as_bool().unwrap() {
            break;
        }
        start_after = Some(keys.last().unwrap().0.clone());
    }
    assert_eq!(pages, 3);
    let expected: Vec<(String, u64)> = (0..25).map(|i| (format!("p/{i:02}"), 10 + i)).collect();
    assert_eq!(keys, expected);

    // Job B sees nothing of job A, and cannot free it.
    let page = client
        .action(
            "enumerate",
            json!({"ctx": ctx("job-b", 1), "bucket": "b", "prefix": ""}),
        )
        .await
        .unwrap();
    assert_eq!(page, json!({"keys": [], "truncated": false}));
    let status = client
        .action(
            "lookup",
            json!({"ctx": ctx("job-b", 1), "bucket": "b", "key": "p/00"}),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    let mut other = client.session("job-b", 1).await.unwrap();
    assert_eq!(
        other
            .run(1, &[simple(1, OpCode::Get, "b", "p/00", 0)])
            .await[&1]
            .status,
        5
    );
    let status = client
        .action(
            "delete_job",
            json!({"ctx": ctx("job-b", 1), "job": "job-a"}),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    let status = client
        .action(
            "enumerate",
            json!({"ctx": ctx("job-b", 1), "bucket": "nope"}),
        )
        .await
        .unwrap_err();
    assert_eq!(
        (status.code(), status_kind(&status)),
        (Code::NotFound, "bucket_not_found".into())
    );
    let status = client
        .action(
            "enumerate",
            json!({"ctx": ctx("job-a", 1), "bucket": "b", "limit": 0}),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
}

#[tokio::test]
async fn deletes_free_space() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    let baseline = client.stats().await["used_bytes"].as_u64().unwrap();
    for bucket in ["b1", "b2"] {
        client.create_bucket("job-a", bucket).await;
    }
    client.create_bucket("job-b", "b1").await;
    let fill = |job: &'static str, bucket: &'static str| {
        let client = client.clone();
        async move {
            let mut session = client.session(job, 1).await.unwrap();
            let ops: Vec<_> = (0..20)
                .map(|i| put(i, bucket, &format!("x/{i}"), pattern(1000, i), 0))
                .collect();
            assert!(session.run(1, &ops).await.values().all(|r| r.status == 0));
        }
    };
    fill("job-a", "b1").await;
    fill("job-a", "b2").await;
    fill("job-b", "b1").await;
    let stats = client.stats().await;
    assert_eq!(stats["objects"], 60);
    assert_eq!(stats["jobs"]["job-a"]["objects"], 40);
    assert_eq!(stats["jobs"]["job-b"]["objects"], 20);

    let deleted = client
        .action(
            "delete_prefix",
            json!({"ctx": ctx("job-a", 1), "bucket": "b1", "prefix": "x/1"}),
        )
        .await
        .unwrap();
    assert_eq!(deleted["deleted"], 11); // x/1 and x/10..x/19
    assert!(deleted["freed_bytes"].as_u64().unwrap() >= 11_000);
    let freed = client
        .action(
            "delete_bucket",
            json!({"ctx": ctx("job-a", 1), "bucket": "b2"}),
        )
        .await
        .unwrap();
    assert!(freed["freed_bytes"].as_u64().unwrap() >= 20_000);
    let status = client
        .action(
            "create_bucket",
            json!({"ctx": ctx("job-a", 1), "bucket": "b2"}),
        )
        .await;
    assert!(status.is_ok(), "a deleted bucket can be created again");
    let deleted = client
        .action(
            "delete",
            json!({"ctx": ctx("job-a", 1), "bucket": "b1", "key": "x/2"}),
        )
        .await
        .unwrap();
    assert_eq!(deleted["size"], 1000);
    assert_eq!(deleted["persist"], false);
    let body =
        json!({"ctx": ctx("job-a", 1), "bucket": "b1", "key": "k", "version": 3, "blocks": [1, 2]});
    assert_eq!(
        client.action("delete_blocks", body).await.unwrap(),
        json!({"freed_bytes": 0})
    );
    let deleted = client
        .action("delete_job", json!({"ctx": ctx("job-a", 1)}))
        .await
        .unwrap();
    assert_eq!(deleted["deleted"], 8);
    let deleted = client
        .action("delete_job", json!({"ctx": admin_ctx(), "job": "job-b"}))
        .await
        .unwrap();
    assert_eq!(deleted["deleted"], 20);
    let status = client
        .action("delete_job", json!({"ctx": admin_ctx()}))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    let stats = client.stats().await;
    assert_eq!(stats["objects"], 0);
    let used = stats["used_bytes"].as_u64().unwrap();
    assert!(
        used <= baseline + 4096,
        "used {used} vs baseline {baseline} (empty buckets may keep a little)"
    );
}

#[tokio::test]
async fn stats_report_every_field() {
    let server = TestServer::start(ServerOptions {
        long_running: true,
        ..Default::default()
    });
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    let ops: Vec<_> = (0..100)
        .map(|i| put(i, "b", &format!("k{i}"), pattern(10_000, i), 0))
        .collect();
    session.run(1, &ops).await;
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let stats = client.stats().await;
    for field in [
        "node_id",
        "tier",
        "long_running",
        "draining",
        "interval_ms",
        "cpu_utilization",
        "bytes_in_per_s",
        "bytes_out_per_s",
        "ops_per_s",
        "throughput_bytes_per_s",
        "capacity_bytes",
        "used_bytes",
        "objects",
        "capacity_refusals",
        "jobs",
    ] {
        assert!(stats.get(field).is_some(), "missing {field} in {stats}");
    }
    assert_eq!(stats["node_id"], "test-node");
    assert_eq!(stats["tier"], "dram");
    assert_eq!(stats["long_running"], true);
    assert_eq!(stats["draining"], false);
    assert_eq!(stats["capacity_bytes"], 64 << 20);
    assert!(stats["used_bytes"].as_u64().unwrap() >= 1_000_000);
    assert_eq!(stats["objects"], 100);
    assert_eq!(stats["jobs"]["job-a"]["objects"], 100);
    let interval = stats["interval_ms"].as_u64().unwrap();
    assert!((900..=3000).contains(&interval), "{interval}");
    let cpu = stats["cpu_utilization"].as_f64().unwrap();
    assert!((0.0..=8.0).contains(&cpu), "{cpu}");
}

#[tokio::test]
async fn stats_report_the_throughput_measured_at_start() {
    for nvme in [false, true] {
        let server = TestServer::start(ServerOptions {
            nvme,
            ..Default::default()
        });
        let client = server.client().await;
        // The self-test ran before the server served: its figure is there from the first call,
        // and its test block is gone.
        let stats = client.stats().await;
        let throughput = stats["throughput_bytes_per_s"].as_u64().unwrap();
        assert!(throughput > 0, "{stats}");
        assert_eq!(stats["used_bytes"], 0, "{stats}");
        assert_eq!(stats["objects"], 0, "{stats}");
        assert!(stats["jobs"].as_object().unwrap().is_empty(), "{stats}");
        // The figure never falls, whatever the traffic since.
        client.create_bucket("job-a", "b").await;
        let mut session = client.session("job-a", 1).await.unwrap();
        let ops: Vec<_> = (0..20)
            .map(|i| put(i, "b", &format!("k{i}"), pattern(10_000, i), 0))
            .collect();
        session.run(1, &ops).await;
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let later = client.stats().await["throughput_bytes_per_s"]
            .as_u64()
            .unwrap();
        assert!(later >= throughput, "{later} < {throughput}");
    }
}

#[tokio::test]
async fn stats_rates_count_traffic() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    // Keep traffic going across a whole sampling interval.
    let until = std::time::Instant::now() + Duration::from_millis(2300);
    let mut id = 0u64;
    while std::time::Instant::now() < until {
        let ops: Vec<_> = (0..50)
            .map(|i| put(id + i, "b", &format!("k{}", id + i), pattern(1000, i), 0))
            .collect();
        session.run(1, &ops).await;
        let ops: Vec<_> = (0..50)
            .map(|i| simple(id + i, OpCode::Delete, "b", &format!("k{}", id + i), 0))
            .collect();
        session.run(1, &ops).await;
        id += 50;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = client.stats().await;
    assert!(stats["ops_per_s"].as_u64().unwrap() > 0, "{stats}");
    assert!(stats["bytes_in_per_s"].as_u64().unwrap() > 0, "{stats}");
    assert!(stats["cpu_utilization"].as_f64().unwrap() > 0.0, "{stats}");
}

#[tokio::test]
async fn drain_refuses_writes_and_exits_when_empty() {
    let mut server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    let ops: Vec<_> = (0..10)
        .map(|i| put(i, "b", &format!("k{i}"), pattern(100, i), 0))
        .collect();
    assert!(session.run(1, &ops).await.values().all(|r| r.status == 0));
    let result = client
        .action(
            "drain",
            json!({"ctx": admin_ctx(), "exit_when_empty": false}),
        )
        .await
        .unwrap();
    assert_eq!(result, json!({"draining": true}));
    assert_eq!(client.stats().await["draining"], true);

    let reply = session
        .run(1, &[put(100, "b", "new", pattern(10, 0), 0)])
        .await;
    assert_eq!(
        (reply[&100].status, reply_kind(&reply[&100])),
        (14, "draining".into())
    );
    let status = client
        .put_blocks(
            put_descriptor("job-a", "b", "x", 1, 1024, false),
            &[(1, pattern(10, 1))],
            10,
        )
        .await
        .unwrap_err();
    assert_eq!(
        (status.code(), status_kind(&status)),
        (Code::Unavailable, "draining".into())
    );
    let status = client
        .action(
            "create_bucket",
            json!({"ctx": ctx("job-a", 1), "bucket": "c"}),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    // Reads, deletes and enumerate still work.
    assert_eq!(
        session
            .run(1, &[simple(101, OpCode::Get, "b", "k0", 0)])
            .await[&101]
            .status,
        0
    );
    let page = client
        .action("enumerate", json!({"ctx": ctx("job-a", 1), "bucket": "b"}))
        .await
        .unwrap();
    assert_eq!(page["keys"].as_array().unwrap().len(), 10);
    assert_eq!(
        session
            .run(1, &[simple(102, OpCode::Delete, "b", "k0", 0)])
            .await[&102]
            .status,
        0
    );

    client
        .action(
            "drain",
            json!({"ctx": admin_ctx(), "exit_when_empty": true}),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "records remain, the server keeps running"
    );
    let ops: Vec<_> = (1..10)
        .map(|i| {
            simple(
                200 + i,
                OpCode::Get,
                "b",
                &format!("k{i}"),
                pocketflow_protocol::frame::OP_FLAG_DELETE,
            )
        })
        .collect();
    assert!(session.run(1, &ops).await.values().all(|r| r.status == 0));
    drop(session);
    let status = server
        .wait_exit(Duration::from_secs(10))
        .expect("server exits once empty");
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn list_actions_and_rpcs_outside_the_protocol() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    let mut inner = client.inner.clone();
    let actions: Vec<String> = inner
        .list_actions(Empty {})
        .await
        .unwrap()
        .into_inner()
        .map(|a| a.unwrap().r#type)
        .collect()
        .await;
    assert_eq!(
        actions,
        [
            "lookup",
            "delete",
            "delete_blocks",
            "enumerate",
            "create_bucket",
            "delete_bucket",
            "delete_prefix",
            "delete_job",
            "set_epoch",
            "stats",
            "drain",
            "set_cores",
            "wait",
            "subscribe",
            "events",
            "unsubscribe",
            "renew_leases",
            "end_leases"
        ]
    );
    let descriptor = FlightDescriptor::new_cmd(Bytes::from_static(b"{}"));
    assert_eq!(
        inner
            .get_flight_info(descriptor.clone())
            .await
            .unwrap_err()
            .code(),
        Code::Unimplemented
    );
    assert_eq!(
        inner
            .poll_flight_info(descriptor.clone())
            .await
            .unwrap_err()
            .code(),
        Code::Unimplemented
    );
    assert_eq!(
        inner.get_schema(descriptor).await.unwrap_err().code(),
        Code::Unimplemented
    );
    let status = match inner.list_flights(Criteria::default()).await {
        Ok(mut s) => s.get_mut().next().await.unwrap().unwrap_err(),
        Err(status) => status,
    };
    assert_eq!(status.code(), Code::Unimplemented);
    let status = match inner
        .handshake(futures::stream::iter(vec![
            arrow_flight::HandshakeRequest::default(),
        ]))
        .await
    {
        Ok(mut s) => s.get_mut().next().await.unwrap().unwrap_err(),
        Err(status) => status,
    };
    assert_eq!(status.code(), Code::Unimplemented);
    let status = client
        .action("reboot", json!({"ctx": admin_ctx()}))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    let _ = Ticket::default();
}

#[tokio::test]
async fn wait_parks_until_every_key_is_put_or_the_deadline() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let wait_body = |keys: &[&str], timeout_ms: u64| json!({"ctx": ctx("job-a", 1), "bucket": "b", "keys": keys, "timeout_ms": timeout_ms});
    // Nothing there: the call is parked for its whole timeout and names every key.
    let started = std::time::Instant::now();
    let result = client
        .action("wait", wait_body(&["k1", "k2"], 300))
        .await
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(result, json!({"missing": ["k1", "k2"]}));

    // A parked call returns as soon as the last key is put, long before its deadline.
    let waiter = {
        let client = server.client().await;
        let body = wait_body(&["k1", "k2"], 20_000);
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            (client.action("wait", body).await, started.elapsed())
        })
    };
    let mut session = client.session("job-a", 1).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    session
        .run(1, &[put(1, "b", "k1", pattern(10, 1), 0)])
        .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished(), "returned with k2 still missing");
    session
        .run(1, &[put(2, "b", "k2", pattern(10, 2), 0)])
        .await;
    let (result, elapsed) = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("wait returns after the put")
        .unwrap();
    assert_eq!(result.unwrap(), json!({"missing": []}));
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");

    // Present keys answer at once; bad bodies and unknown buckets are refused.
    assert_eq!(
        client.action("wait", wait_body(&["k2"], 0)).await.unwrap(),
        json!({"missing": []})
    );
    let status = client.action("wait", wait_body(&[], 10)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    let status = client
        .action("wait", wait_body(&["k"], 30_001))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    let body = json!({"ctx": ctx("job-a", 1), "bucket": "nope", "keys": ["k"], "timeout_ms": 10});
    let status = client.action("wait", body).await.unwrap_err();
    assert_eq!(status_kind(&status), "bucket_not_found");
    // Another job's token does not see job-a's keys.
    let body = json!({"ctx": ctx("job-b", 1), "bucket": "b", "keys": ["k1"], "timeout_ms": 0});
    assert!(client.action("wait", body).await.is_err());

    // Deleting the bucket wakes a parked call, which then fails instead of sitting out its time.
    let waiter = {
        let client = server.client().await;
        let body = wait_body(&["never"], 20_000);
        tokio::spawn(async move { client.action("wait", body).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    client
        .action(
            "delete_bucket",
            json!({"ctx": ctx("job-a", 1), "bucket": "b"}),
        )
        .await
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("a deleted bucket ends the wait")
        .unwrap()
        .unwrap_err();
    assert_eq!(status_kind(&status), "bucket_not_found");
}

#[tokio::test]
async fn a_job_the_admin_deleted_is_ended_for_writes_and_keeps_its_persist_data_readable() {
    let server = TestServer::start(ServerOptions {
        long_running: true,
        ..Default::default()
    });
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    client.create_bucket("job-b", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    let replies = session
        .run(
            1,
            &[
                put(1, "b", "gone", pattern(100, 1), 0),
                put(2, "b", "kept", pattern(100, 2), OP_FLAG_PERSIST),
            ],
        )
        .await;
    assert_eq!((replies[&1].status, replies[&2].status), (0, 0));

    let deleted = client
        .action("delete_job", json!({"ctx": admin_ctx(), "job": "job-a"}))
        .await
        .unwrap();
    assert_eq!(deleted["deleted"], 1);

    // The open session still reads what is left, but a put is refused, at any epoch.
    let replies = session
        .run(
            7,
            &[
                simple(3, OpCode::Get, "b", "kept", 0),
                put(4, "b", "new", pattern(100, 4), 0),
                put(
                    5,
                    "b",
                    "kept",
                    pattern(100, 5),
                    OP_FLAG_PERSIST | OP_FLAG_OVERWRITE,
                ),
            ],
        )
        .await;
    assert_eq!(replies[&3].status, 0);
    assert_eq!(replies[&3].body, pattern(100, 2));
    assert_eq!(reply_kind(&replies[&4]), "job_not_registered");
    assert_eq!(reply_kind(&replies[&5]), "job_not_registered");
    // A straggler's token cannot bring the job back with a new bucket or a block upload, and the
    // admin cannot give the job an epoch again; listing and deleting what is left still work.
    for (name, body) in [
        (
            "create_bucket",
            json!({"ctx": ctx("job-a", 1), "bucket": "c"}),
        ),
        (
            "set_epoch",
            json!({"ctx": admin_ctx(), "job": "job-a", "epoch": 2, "map": {}}),
        ),
    ] {
        let status = client.action(name, body).await.unwrap_err();
        assert_eq!(status.code(), Code::NotFound, "{name}");
        assert_eq!(status_kind(&status), "job_not_registered", "{name}");
    }
    let descriptor = put_descriptor("job-a", "b", "big", 7, 1024, false);
    let status = client
        .put_blocks(descriptor, &[(1, pattern(1024, 7))], 1024)
        .await
        .unwrap_err();
    assert_eq!(status_kind(&status), "job_not_registered");
    let listed = client
        .action(
            "enumerate",
            json!({"ctx": ctx("job-a", 1), "bucket": "b", "prefix": "", "limit": 10}),
        )
        .await
        .unwrap();
    assert_eq!(listed["keys"], json!([{"key": "kept", "size": 100}]));
    client
        .action(
            "delete",
            json!({"ctx": ctx("job-a", 1), "bucket": "b", "key": "kept"}),
        )
        .await
        .unwrap();
    // Other jobs are untouched.
    let mut other = client.session("job-b", 1).await.unwrap();
    let replies = other.run(1, &[put(1, "b", "k", pattern(100, 9), 0)]).await;
    assert_eq!(replies[&1].status, 0);
    assert_eq!(client.stats().await["objects"], 1);
}

#[tokio::test]
async fn the_admin_deletes_what_an_ended_job_left_persist_data_included() {
    let server = TestServer::start(ServerOptions {
        long_running: true,
        ..Default::default()
    });
    let client = server.client().await;
    let baseline = client.stats().await["used_bytes"].as_u64().unwrap();
    client.create_bucket("job-c", "b").await;
    let mut session = client.session("job-c", 1).await.unwrap();
    let replies = session
        .run(1, &[put(1, "b", "kept", pattern(5000, 1), OP_FLAG_PERSIST)])
        .await;
    assert_eq!(replies[&1].status, 0);
    let ended = client
        .action("delete_job", json!({"ctx": admin_ctx(), "job": "job-c"}))
        .await
        .unwrap();
    assert_eq!(ended["deleted"], 0);
    assert_eq!(client.stats().await["jobs"]["job-c"]["objects"], 1);

    // Only the admin may take PERSIST data.
    let status = client
        .action(
            "delete_job",
            json!({"ctx": ctx("job-c", 1), "persist": true}),
        )
        .await
        .unwrap_err();
    assert_eq!(status_kind(&status), "permission_denied");
    let deleted = client
        .action(
            "delete_job",
            json!({"ctx": admin_ctx(), "job": "job-c", "persist": true}),
        )
        .await
        .unwrap();
    assert_eq!(deleted["deleted"], 1);
    let stats = client.stats().await;
    assert_eq!(stats["objects"], 0);
    assert!(stats["jobs"].get("job-c").is_none());
    let used = stats["used_bytes"].as_u64().unwrap();
    assert!(
        used <= baseline + 4096,
        "used {used} vs baseline {baseline}"
    );
}
