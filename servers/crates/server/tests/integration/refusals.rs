//! Refused writes are counted by the limit they hit, in `stats` (server-wide and per job) and
//! in the metrics' `pocketflow_capacity_refusals_total`; `stats` lists a job that holds only a
//! reservation share here.

use serde_json::{json, Value};

use crate::harness::*;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

/// The value of the refusal counter of `limit` in a metrics text.
fn refusals_metric(text: &str, limit: &str) -> u64 {
    let label = format!("limit=\"{limit}\"");
    let line = text
        .lines()
        .find(|line| {
            line.starts_with("pocketflow_capacity_refusals_total{") && line.contains(&label)
        })
        .unwrap_or_else(|| panic!("no refusals series of {limit} in:\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

fn refusals(counts: &Value) -> [u64; 5] {
    ["data", "records", "reserved", "extent", "freeing"].map(|limit| {
        counts[limit]
            .as_u64()
            .unwrap_or_else(|| panic!("no {limit} in {counts}"))
    })
}

#[tokio::test]
async fn a_write_refused_for_want_of_a_free_extent_is_counted_as_extent() {
    // Fifteen 64 KiB objects fill a 1 MiB DRAM tier's room for data; deleting every other one
    // leaves 512 KiB free in 64 KiB holes, so a 128 KiB block fits the budget but no extent.
    let server = TestServer::start(ServerOptions {
        capacity: "1MiB".into(),
        metrics: true,
        ..Default::default()
    });
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    client.create_bucket("job-b", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    let puts: Vec<_> = (0..15)
        .map(|i| put(i, "b", &format!("k{i}"), pattern(64 * KIB as usize, i), 0))
        .collect();
    let replies = session.run(1, &puts).await;
    assert!(replies.values().all(|r| r.status == 0), "{replies:?}");
    for i in (1..15).step_by(2) {
        client
            .action(
                "delete",
                json!({"ctx": ctx("job-a", 1), "bucket": "b", "key": format!("k{i}")}),
            )
            .await
            .unwrap();
    }
    assert_eq!(refusals(&client.stats().await["capacity_refusals"]), [0; 5]);
    assert_eq!(refusals_metric(&server.metrics().await, "extent"), 0);

    let descriptor = put_descriptor("job-a", "b", "large", 1, 128 * KIB as u32, false);
    let status = client
        .put_blocks(
            descriptor,
            &[(1, pattern(128 * KIB as usize, 99))],
            64 * 1024,
        )
        .await
        .unwrap_err();
    assert_eq!(status_kind(&status), "capacity_exhausted");
    assert!(
        status.message().contains("no free extent"),
        "{}",
        status.message()
    );
    let stats = client.stats().await;
    assert_eq!(refusals(&stats["capacity_refusals"]), [0, 0, 0, 1, 0]);
    assert_eq!(
        refusals(&stats["jobs"]["job-a"]["capacity_refusals"]),
        [0, 0, 0, 1, 0]
    );
    assert_eq!(
        refusals(&stats["jobs"]["job-b"]["capacity_refusals"]),
        [0; 5]
    );
    let metrics = server.metrics().await;
    assert_eq!(refusals_metric(&metrics, "extent"), 1);
    for limit in ["data", "records", "reserved", "freeing"] {
        assert_eq!(refusals_metric(&metrics, limit), 0, "{limit}");
    }
}

#[tokio::test]
async fn a_write_beyond_others_shares_is_counted_as_reserved_and_a_share_alone_is_listed() {
    // Job B holds a 6 MiB share of an 8 MiB DRAM server and no bucket; job A writes 64 KiB
    // objects until the room left beside B's share is gone.
    let server = TestServer::start(ServerOptions {
        capacity: "8MiB".into(),
        metrics: true,
        ..Default::default()
    });
    let client = server.client().await;
    let share = 6 * MIB;
    client
        .action(
            "set_epoch",
            json!({"ctx": admin_ctx(), "job": "job-b", "epoch": 1,
                   "map": {"epoch": 1, "reserved_bytes": {"test-node": share}}}),
        )
        .await
        .unwrap();
    let stats = client.stats().await;
    assert_eq!(stats["jobs"]["job-b"]["reserved_bytes"], share);
    assert_eq!(stats["jobs"]["job-b"]["used_bytes"], 0);
    assert_eq!(
        refusals(&stats["jobs"]["job-b"]["capacity_refusals"]),
        [0; 5]
    );

    client.create_bucket("job-a", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    let mut stored = 0u64;
    let refused = loop {
        let value = pattern(64 * KIB as usize, stored);
        let replies = session
            .run(1, &[put(stored, "b", &format!("k{stored}"), value, 0)])
            .await;
        let reply = &replies[&stored];
        if reply.status != 0 {
            break reply_kind(reply);
        }
        stored += 1;
        assert!(stored < 64, "never refused");
    };
    assert_eq!(refused, "capacity_exhausted");
    // About 2 MiB (less the records' reserve) fitted beside B's share.
    assert!((20..32).contains(&stored), "{stored} objects stored");
    let stats = client.stats().await;
    assert_eq!(refusals(&stats["capacity_refusals"]), [0, 0, 1, 0, 0]);
    assert_eq!(
        refusals(&stats["jobs"]["job-a"]["capacity_refusals"]),
        [0, 0, 1, 0, 0]
    );
    assert_eq!(
        refusals(&stats["jobs"]["job-b"]["capacity_refusals"]),
        [0; 5]
    );
    assert_eq!(stats["jobs"]["job-b"]["reserved_bytes"], share);
    assert_eq!(refusals_metric(&server.metrics().await, "reserved"), 1);

    // B's share ends with B (delete_job); B leaves the list, A's count stays.
    client
        .action("delete_job", json!({"ctx": admin_ctx(), "job": "job-b"}))
        .await
        .unwrap();
    let stats = client.stats().await;
    assert!(stats["jobs"].get("job-b").is_none(), "{stats}");
    assert_eq!(
        refusals(&stats["jobs"]["job-a"]["capacity_refusals"]),
        [0, 0, 1, 0, 0]
    );
}
