//! Only registered jobs write (docs/PROTOCOL.md, "Registered jobs"): a server accepts a job's
//! writes only once the control plane told it the job's epoch, and never again once it ended the
//! job there, however many jobs end after it; reads and deletes of what an ended job left work.

use pocketflow_flight::bounds::ENDED_JOBS_MAX;
use pocketflow_protocol::frame::{OpCode, OP_FLAG_PERSIST};
use serde_json::{json, Value};
use tonic::{Code, Status};

use crate::harness::*;

/// The writes of DoAction that a job's token may ask for, each of `job`.
fn action_writes(job: &str) -> [(&'static str, Value); 3] {
    [
        ("create_bucket", json!({"ctx": ctx(job, 1), "bucket": "c"})),
        (
            "renew_leases",
            json!({"ctx": ctx(job, 1), "prefixes": ["p"], "lease_ms": 10_000}),
        ),
        (
            "subscribe",
            json!({"ctx": ctx(job, 1), "bucket": "b", "ops": ["put"]}),
        ),
    ]
}

fn assert_refused(status: &Status, job: &str, why: &str, what: &str) {
    assert_eq!(status.code(), Code::NotFound, "{what}: {status:?}");
    let expected = format!("job_not_registered: job \"{job}\" {why}");
    assert!(
        status.message().starts_with(&expected),
        "{what}: {:?} does not start with {expected:?}",
        status.message()
    );
}

#[tokio::test]
async fn a_job_the_server_was_not_told_about_writes_nothing_until_it_is() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    // A valid token of a job this server was never told about, as on a new or restarted server.
    for (name, body) in action_writes("job-a") {
        let status = client.action(name, body).await.unwrap_err();
        assert_refused(&status, "job-a", "is not registered on server", name);
    }
    let status = client
        .put_blocks(
            put_descriptor("job-a", "b", "big", 1, 1024, false),
            &[(1, pattern(1024, 1))],
            1024,
        )
        .await
        .unwrap_err();
    assert_refused(&status, "job-a", "is not registered on server", "DoPut");
    // A session opens (reads are served), but its put is refused.
    let mut session = client.session("job-a", 1).await.unwrap();
    let replies = session
        .run(
            1,
            &[
                put(1, "b", "k", pattern(10, 1), 0),
                simple(2, OpCode::Lookup, "b", "k", 0),
            ],
        )
        .await;
    assert_eq!(reply_kind(&replies[&1]), "job_not_registered");
    assert_eq!(reply_kind(&replies[&2]), "bucket_not_found");
    assert_eq!(client.stats().await["objects"], 0);

    // Once the control plane tells the server, the same token and session write.
    client.register("job-a").await;
    client
        .action(
            "create_bucket",
            json!({"ctx": ctx("job-a", 1), "bucket": "b"}),
        )
        .await
        .unwrap();
    let replies = session.run(1, &[put(3, "b", "k", pattern(10, 3), 0)]).await;
    assert_eq!(replies[&3].status, 0);
    for (name, body) in action_writes("job-a") {
        client.action(name, body).await.unwrap();
    }
    // Other jobs are still not registered.
    let status = client
        .action(
            "create_bucket",
            json!({"ctx": ctx("job-b", 1), "bucket": "b"}),
        )
        .await
        .unwrap_err();
    assert_refused(&status, "job-b", "is not registered on server", "job-b");
}

#[tokio::test]
async fn an_ended_jobs_token_never_writes_again_however_many_jobs_end_after_it() {
    let server = TestServer::start(ServerOptions {
        long_running: true,
        ..Default::default()
    });
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    let replies = session
        .run(1, &[put(1, "b", "kept", pattern(100, 1), OP_FLAG_PERSIST)])
        .await;
    assert_eq!(replies[&1].status, 0);
    client
        .action("delete_job", json!({"ctx": admin_ctx(), "job": "job-a"}))
        .await
        .unwrap();
    let status = client
        .action(
            "create_bucket",
            json!({"ctx": ctx("job-a", 1), "bucket": "c"}),
        )
        .await
        .unwrap_err();
    assert_refused(
        &status,
        "job-a",
        "was deregistered: it ended on server",
        "create_bucket after the end",
    );

    // Twice as many jobs end after it as the server remembers ended jobs.
    for i in 0..2 * ENDED_JOBS_MAX {
        client
            .action(
                "delete_job",
                json!({"ctx": admin_ctx(), "job": format!("later-{i}")}),
            )
            .await
            .unwrap();
    }
    // Forgotten as ended, job-a is still not registered: none of its writes is accepted.
    for (name, body) in action_writes("job-a") {
        let status = client.action(name, body).await.unwrap_err();
        assert_refused(&status, "job-a", "is not registered on server", name);
    }
    let replies = session
        .run(1, &[put(2, "b", "new", pattern(10, 2), 0)])
        .await;
    assert_eq!(reply_kind(&replies[&2]), "job_not_registered");
    let status = client
        .put_blocks(
            put_descriptor("job-a", "b", "big", 1, 1024, true),
            &[(1, pattern(1024, 1))],
            1024,
        )
        .await
        .unwrap_err();
    assert_refused(&status, "job-a", "is not registered on server", "DoPut");

    // What it left is still read and deleted with its token.
    let replies = session
        .run(1, &[simple(3, OpCode::Get, "b", "kept", 0)])
        .await;
    assert_eq!(
        (replies[&3].status, replies[&3].body.clone()),
        (0, pattern(100, 1))
    );
    client
        .action(
            "delete",
            json!({"ctx": ctx("job-a", 1), "bucket": "b", "key": "kept"}),
        )
        .await
        .unwrap();
    assert_eq!(client.stats().await["objects"], 0);
}
