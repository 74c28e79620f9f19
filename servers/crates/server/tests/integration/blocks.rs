//! DoPut and DoGet of data blocks: multi-block objects, ranges, delete, failures that leave
//! nothing, capacity exhaustion, a small op during a paused upload, and the NVMe tier.

use std::time::Duration;

use arrow_flight::FlightData;
use bytes::Bytes;
use futures::StreamExt;
use pocketflow_protocol::batch::PutPieceMeta;
use pocketflow_protocol::frame::{OpCode, OP_FLAG_DELETE};
use pocketflow_protocol::ObjectHeader;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

use crate::harness::*;

const MIB: usize = 1 << 20;

fn ticket(
    job: &str,
    key: &str,
    version: u64,
    ranges: serde_json::Value,
    delete: bool,
) -> serde_json::Value {
    json!({"ctx": ctx(job, 1), "bucket": "b", "key": key, "version": version, "ranges": ranges, "delete": delete})
}

async fn used_bytes(client: &Client) -> u64 {
    client.stats().await["used_bytes"].as_u64().unwrap()
}

async fn large_object_round_trip(options: ServerOptions) {
    let server = TestServer::start(options);
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let baseline = used_bytes(&client).await;

    // 3.5 MiB in 1 MiB blocks, sent in 300 KiB pieces, so blocks span several batches.
    let size = 3 * MIB + MIB / 2;
    let object = pattern(size, 42);
    let version = 0xfeed_beef;
    let blocks: Vec<(u32, Bytes)> = object
        .chunks(MIB)
        .enumerate()
        .map(|(i, c)| (i as u32 + 1, Bytes::copy_from_slice(c)))
        .collect();
    let result = client
        .put_blocks(
            put_descriptor("job-a", "b", "big", version, MIB as u32, false),
            &blocks,
            300 * 1024,
        )
        .await
        .unwrap();
    assert_eq!(result, json!({"blocks": 4, "bytes": size}));

    let header = ObjectHeader {
        version,
        size: size as u64,
        block_count: 4,
        block_size: MIB as u32,
        flags: 0,
    };
    let mut session = client.session("job-a", 1).await.unwrap();
    assert_eq!(
        session.run(1, &[manifest(1, "b", "big", header, 0)]).await[&1].status,
        0
    );
    let got = session
        .run(1, &[simple(2, OpCode::Get, "b", "big", 0)])
        .await;
    assert_eq!(got[&2].header, Some(header));
    assert!(got[&2].body.is_empty());

    // Whole object, then ranges.
    let ranges = json!([[1, 0, MIB], [2, 0, MIB], [3, 0, MIB], [4, 0, MIB / 2]]);
    let pieces = client
        .get_ranges(ticket("job-a", "big", version, ranges, false))
        .await
        .unwrap();
    let joined: Vec<u8> = pieces.iter().flat_map(|(_, b)| b.iter().copied()).collect();
    assert_eq!(Bytes::from(joined), object);
    let ranges = json!([[2, 4096, 512], [4, 100, 10], [1, 0, 1]]);
    let pieces = client
        .get_ranges(ticket("job-a", "big", version, ranges, false))
        .await
        .unwrap();
    assert_eq!(pieces.len(), 3);
    assert_eq!(
        (pieces[0].0.block_index, pieces[0].0.offset, pieces[0].0.len),
        (2, 4096, 512)
    );
    assert_eq!(pieces[0].1, object.slice(MIB + 4096..MIB + 4096 + 512));
    assert_eq!(pieces[1].1, object.slice(3 * MIB + 100..3 * MIB + 110));
    assert_eq!(pieces[2].1, object.slice(0..1));

    let status = client
        .get_ranges(ticket("job-a", "big", version, json!([[4, 0, MIB]]), false))
        .await
        .unwrap_err();
    assert_eq!(
        (status.code(), status_kind(&status)),
        (Code::InvalidArgument, "invalid_argument".into())
    );
    let status = client
        .get_ranges(ticket("job-a", "big", version, json!([[5, 0, 1]]), false))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    let status = client
        .get_ranges(ticket(
            "job-a",
            "big",
            version + 1,
            json!([[1, 0, 1]]),
            false,
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);

    // DELETE-on-read of the manifest, then the blocks with delete.
    let got = session
        .run(1, &[simple(3, OpCode::Get, "b", "big", OP_FLAG_DELETE)])
        .await;
    assert_eq!(got[&3].header, Some(header));
    let ranges = json!([[1, 0, MIB], [2, 0, MIB], [3, 0, MIB], [4, 0, MIB / 2]]);
    let pieces = client
        .get_ranges(ticket("job-a", "big", version, ranges.clone(), true))
        .await
        .unwrap();
    assert_eq!(pieces.iter().map(|(_, b)| b.len()).sum::<usize>(), size);
    let status = client
        .get_ranges(ticket("job-a", "big", version, json!([[1, 0, 1]]), false))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    wait_used(&client, baseline).await;
}

async fn wait_used(client: &Client, expected: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let used = used_bytes(client).await;
        if used == expected {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "used_bytes {used} never returned to {expected}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn multi_block_put_get_ranges_and_delete_dram() {
    large_object_round_trip(ServerOptions::default()).await;
}

#[tokio::test]
async fn multi_block_put_get_ranges_and_delete_nvme() {
    large_object_round_trip(ServerOptions {
        nvme: true,
        ..Default::default()
    })
    .await;
}

#[tokio::test]
async fn big_blocks_travel_in_batches_of_at_most_4_mib() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let block = pattern(9 * MIB, 3);
    let result = client
        .put_blocks(
            put_descriptor("job-a", "b", "k", 9, 16 * MIB as u32, false),
            &[(1, block.clone())],
            4 * MIB,
        )
        .await
        .unwrap();
    assert_eq!(result["bytes"], 9 * MIB);
    let pieces = client
        .get_ranges(ticket("job-a", "k", 9, json!([[1, 0, 9 * MIB]]), false))
        .await
        .unwrap();
    let lens: Vec<usize> = pieces.iter().map(|(_, b)| b.len()).collect();
    assert_eq!(lens, vec![4 * MIB, 4 * MIB, MIB]);
    assert_eq!(pieces[1].0.offset, 4 * MIB as u64);
    let joined: Vec<u8> = pieces.iter().flat_map(|(_, b)| b.iter().copied()).collect();
    assert_eq!(Bytes::from(joined), block);
}

#[tokio::test]
async fn failed_uploads_leave_nothing() {
    let server = TestServer::start(ServerOptions {
        capacity: "16MiB".into(),
        ..Default::default()
    });
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let baseline = used_bytes(&client).await;

    // The stream ends in the middle of block 2: block 1 (complete) is freed too.
    let mut messages = put_messages(
        put_descriptor("job-a", "b", "k", 7, MIB as u32, false),
        &[(1, pattern(MIB, 1)), (2, pattern(MIB, 2))],
        256 * 1024,
    );
    messages.truncate(messages.len() - 1);
    let mut inner = client.inner.clone();
    let status = match inner.do_put(futures::stream::iter(messages)).await {
        Ok(response) => response.into_inner().next().await.unwrap().unwrap_err(),
        Err(status) => status,
    };
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(client
        .get_ranges(ticket("job-a", "k", 7, json!([[1, 0, 1]]), false))
        .await
        .is_err());
    wait_used(&client, baseline).await;

    // More than the tier holds: capacity_exhausted, and nothing remains.
    let blocks: Vec<(u32, Bytes)> = (1..=5).map(|i| (i, pattern(4 * MIB, i as u64))).collect();
    let status = client
        .put_blocks(
            put_descriptor("job-a", "b", "k", 8, 4 * MIB as u32, false),
            &blocks,
            4 * MIB,
        )
        .await
        .unwrap_err();
    assert_eq!(
        (status.code(), status_kind(&status)),
        (Code::ResourceExhausted, "capacity_exhausted".into())
    );
    wait_used(&client, baseline).await;

    // Small objects until full: the failing put leaves nothing, deletes give the space back.
    let mut session = client.session("job-a", 1).await.unwrap();
    let mut stored = 0u64;
    loop {
        let reply = session
            .run(
                1,
                &[put(
                    stored,
                    "b",
                    &format!("s{stored}"),
                    pattern(60_000, stored),
                    0,
                )],
            )
            .await;
        let reply = &reply[&stored];
        if reply.status != 0 {
            assert_eq!(
                (reply.status, reply_kind(reply)),
                (8, "capacity_exhausted".into())
            );
            break;
        }
        stored += 1;
        assert!(
            stored < 1000,
            "a 16 MiB tier cannot hold 1000 objects of 60 KB"
        );
    }
    assert!(stored > 100);
    let deleted = client
        .action(
            "delete_prefix",
            json!({"ctx": ctx("job-a", 1), "bucket": "b", "prefix": "s"}),
        )
        .await
        .unwrap();
    assert_eq!(deleted["deleted"], stored);
    wait_used(&client, baseline).await;

    // Malformed pieces: wrong metadata, pieces past the block, a block longer than block_size.
    for (meta, piece_len) in [
        (Bytes::from_static(b"short"), 10usize),
        (
            Bytes::copy_from_slice(
                &PutPieceMeta {
                    block_index: 1,
                    block_len: 5,
                }
                .encode(),
            ),
            10,
        ),
        (
            Bytes::copy_from_slice(
                &PutPieceMeta {
                    block_index: 1,
                    block_len: 2 * MIB as u64,
                }
                .encode(),
            ),
            10,
        ),
        (
            Bytes::copy_from_slice(
                &PutPieceMeta {
                    block_index: 0,
                    block_len: 10,
                }
                .encode(),
            ),
            10,
        ),
    ] {
        let mut messages = put_messages(
            put_descriptor("job-a", "b", "m", 9, MIB as u32, false),
            &[],
            1,
        );
        messages.push(piece_message(&pattern(piece_len, 0), meta));
        let mut inner = client.inner.clone();
        let status = match inner.do_put(futures::stream::iter(messages)).await {
            Ok(response) => response.into_inner().next().await.unwrap().unwrap_err(),
            Err(status) => status,
        };
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    }
    wait_used(&client, baseline).await;
}

#[tokio::test]
async fn small_op_completes_while_a_big_upload_is_paused() {
    let server = TestServer::start(ServerOptions {
        capacity: "256MiB".into(),
        ..Default::default()
    });
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let block = pattern(64 * MIB, 5);
    let descriptor = put_descriptor("job-a", "b", "huge", 11, 16 * MIB as u32, false);
    let blocks: Vec<(u32, Bytes)> = block
        .chunks(16 * MIB)
        .enumerate()
        .map(|(i, c)| (i as u32 + 1, Bytes::copy_from_slice(c)))
        .collect();
    let messages = put_messages(descriptor, &blocks, 4 * MIB);
    let (tx, rx) = mpsc::channel::<FlightData>(1);
    let mut inner = client.inner.clone();
    let upload = tokio::spawn(async move { inner.do_put(ReceiverStream::new(rx)).await });
    let mut messages = messages.into_iter();
    for message in messages.by_ref().take(6) {
        tx.send(message).await.unwrap();
    }
    // The upload is paused mid-block; a 1 KiB put and get on the same connection still complete.
    let mut session = client.session("job-a", 1).await.unwrap();
    let started = std::time::Instant::now();
    let replies = tokio::time::timeout(
        Duration::from_secs(5),
        session.run(1, &[put(1, "b", "small", pattern(1024, 9), 0)]),
    )
    .await
    .expect("small put is not blocked by the paused upload");
    assert_eq!(replies[&1].status, 0);
    let replies = session
        .run(1, &[simple(2, OpCode::Get, "b", "small", 0)])
        .await;
    assert_eq!(replies[&2].body, pattern(1024, 9));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "small ops took {:?}",
        started.elapsed()
    );
    for message in messages {
        tx.send(message).await.unwrap();
    }
    drop(tx);
    let mut results = upload.await.unwrap().unwrap().into_inner();
    let result = results.next().await.unwrap().unwrap();
    let result: serde_json::Value = serde_json::from_slice(&result.app_metadata).unwrap();
    assert_eq!(result, json!({"blocks": 4, "bytes": 64 * MIB}));
}

/// The first error status of a stream, after any data messages; the data bytes before it.
async fn status_after_data(
    stream: &mut tonic::Streaming<FlightData>,
) -> (usize, Option<tonic::Status>) {
    let mut received = 0;
    while let Some(message) = stream.next().await {
        match message {
            Ok(data) => received += data.data_body.len(),
            Err(status) => return (received, Some(status)),
        }
    }
    (received, None)
}

#[tokio::test]
async fn idle_transfers_are_ended_and_leave_nothing() {
    let server = TestServer::start(ServerOptions {
        capacity: "256MiB".into(),
        transfer_idle: Some("300ms".into()),
        ..Default::default()
    });
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let baseline = used_bytes(&client).await;

    // A DoPut that stops sending mid-block is ended; its partial block is freed.
    let block = pattern(16 * MIB, 3);
    let descriptor = put_descriptor("job-a", "b", "stalled", 5, 16 * MIB as u32, false);
    let messages = put_messages(descriptor, &[(1, block)], MIB);
    let (tx, rx) = mpsc::channel::<FlightData>(1);
    let mut inner = client.inner.clone();
    let upload = tokio::spawn(async move { inner.do_put(ReceiverStream::new(rx)).await });
    for message in messages.into_iter().take(3) {
        tx.send(message).await.unwrap();
    }
    let status = match tokio::time::timeout(Duration::from_secs(10), upload)
        .await
        .expect("the server ends an idle DoPut")
        .unwrap()
    {
        Err(status) => status,
        Ok(response) => response
            .into_inner()
            .next()
            .await
            .expect("a PutResult or a status")
            .expect_err("an idle DoPut ends with a status"),
    };
    assert_eq!(
        (status.code(), status_kind(&status)),
        (Code::InvalidArgument, "invalid_argument".into())
    );
    assert!(
        status.message().contains("DoPut moved nothing"),
        "{status:?}"
    );
    drop(tx);
    wait_used(&client, baseline).await;

    // A DoGet whose client stops reading is ended after the bytes already queued.
    let big = pattern(64 * MIB, 4);
    let blocks: Vec<(u32, Bytes)> = big
        .chunks(16 * MIB)
        .enumerate()
        .map(|(i, c)| (i as u32 + 1, Bytes::copy_from_slice(c)))
        .collect();
    client
        .put_blocks(
            put_descriptor("job-a", "b", "big", 6, 16 * MIB as u32, false),
            &blocks,
            4 * MIB,
        )
        .await
        .unwrap();
    let ranges: Vec<serde_json::Value> = (1..=4).map(|i| json!([i, 0, 16 * MIB])).collect();
    let mut inner = client.inner.clone();
    let mut stream = inner
        .do_get(arrow_flight::Ticket {
            ticket: ticket("job-a", "big", 6, json!(ranges), false)
                .to_string()
                .into(),
        })
        .await
        .unwrap()
        .into_inner();
    stream.next().await.expect("schema").unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (received, status) =
        tokio::time::timeout(Duration::from_secs(10), status_after_data(&mut stream))
            .await
            .expect("the stream ends");
    let status = status.expect("an idle DoGet ends with a status");
    assert!(
        status.message().contains("DoGet moved nothing"),
        "{status:?}"
    );
    assert!(received < 64 * MIB, "all {received} bytes arrived");
    // The object itself is untouched and reads whole.
    let pieces = client
        .get_ranges(ticket("job-a", "big", 6, json!(ranges), false))
        .await
        .unwrap();
    let total: usize = pieces.iter().map(|(_, bytes)| bytes.len()).sum();
    assert_eq!(total, 64 * MIB);
}

/// A block upload that runs while the admin ends its job stores nothing, also in a bucket that
/// the job's PERSIST data keeps alive.
#[tokio::test]
async fn an_upload_spanning_the_end_of_its_job_leaves_nothing() {
    let server = TestServer::start(ServerOptions {
        long_running: true,
        ..Default::default()
    });
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    let replies = session
        .run(
            1,
            &[put(
                1,
                "b",
                "kept",
                pattern(100, 1),
                pocketflow_protocol::frame::OP_FLAG_PERSIST,
            )],
        )
        .await;
    assert_eq!(replies[&1].status, 0);
    let used_before = client.stats().await["used_bytes"].as_u64().unwrap();

    let blocks: Vec<(u32, Bytes)> = (1..=3).map(|i| (i, pattern(MIB, u64::from(i)))).collect();
    let descriptor = put_descriptor("job-a", "b", "late", 21, MIB as u32, false);
    let messages = put_messages(descriptor, &blocks, MIB);
    let (tx, rx) = mpsc::channel::<FlightData>(1);
    let mut inner = client.inner.clone();
    let upload = tokio::spawn(async move { inner.do_put(ReceiverStream::new(rx)).await });
    let mut messages = messages.into_iter();
    // The schema and the first block.
    for message in messages.by_ref().take(2) {
        tx.send(message).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    client
        .action("delete_job", json!({"ctx": admin_ctx(), "job": "job-a"}))
        .await
        .unwrap();
    for message in messages {
        if tx.send(message).await.is_err() {
            break; // the server ended the stream
        }
    }
    drop(tx);
    let status = match upload.await.unwrap() {
        Err(status) => status,
        Ok(response) => {
            let mut results = response.into_inner();
            results
                .next()
                .await
                .expect("a result or a status")
                .unwrap_err()
        }
    };
    assert_eq!(status_kind(&status), "job_not_registered");
    // Only the PERSIST record is left.
    let mut used = 0;
    for _ in 0..50 {
        used = client.stats().await["used_bytes"].as_u64().unwrap();
        if used == used_before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(used, used_before);
    assert_eq!(client.stats().await["objects"], 1);
}

/// A DoPut descriptor whose upload also stores the manifest of an object of `size` bytes.
fn committing(key: &str, version: u64, size: usize, overwrite: bool) -> serde_json::Value {
    let mut descriptor = put_descriptor("job-a", "b", key, version, MIB as u32, false);
    descriptor["commit"] = json!({"size": size, "overwrite": overwrite});
    descriptor
}

fn blocks_of(object: &Bytes) -> Vec<(u32, Bytes)> {
    object
        .chunks(MIB)
        .enumerate()
        .map(|(i, c)| (i as u32 + 1, Bytes::copy_from_slice(c)))
        .collect()
}

/// The header LOOKUP finds for `key` (status 5, not_found: `None`), at the job's `epoch`.
async fn lookup_at(client: &Client, key: &str, epoch: u64) -> Option<ObjectHeader> {
    let mut session = client.session("job-a", epoch).await.unwrap();
    let reply = session
        .run(epoch, &[simple(1, OpCode::Lookup, "b", key, 0)])
        .await
        .remove(&1)
        .unwrap();
    match reply.status {
        0 => reply.header,
        5 => None,
        other => panic!("lookup of {key}: status {other} {}", reply_kind(&reply)),
    }
}

async fn lookup(client: &Client, key: &str) -> Option<ObjectHeader> {
    lookup_at(client, key, 1).await
}

#[tokio::test]
async fn an_upload_with_a_commit_stores_the_manifest_only_after_every_block() {
    let server = TestServer::start(ServerOptions {
        capacity: "16MiB".into(),
        ..Default::default()
    });
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let baseline = used_bytes(&client).await;
    let size = 2 * MIB + MIB / 2;
    let object = pattern(size, 3);
    let header = ObjectHeader {
        version: 21,
        size: size as u64,
        block_count: 3,
        block_size: MIB as u32,
        flags: 0,
    };

    // Every block, then the manifest: the object is there, whole.
    let result = client
        .put_blocks(committing("k", 21, size, false), &blocks_of(&object), MIB)
        .await
        .unwrap();
    assert_eq!(
        result,
        json!({"blocks": 3, "bytes": size, "committed": true})
    );
    assert_eq!(lookup(&client, "k").await, Some(header));
    let pieces = client
        .get_ranges(ticket("job-a", "k", 21, json!([[3, 0, MIB / 2]]), false))
        .await
        .unwrap();
    assert_eq!(pieces[0].1, object.slice(2 * MIB..));
    let stored = used_bytes(&client).await;

    // Write-once: a second commit of the key is refused, and its blocks are freed.
    let status = client
        .put_blocks(committing("k", 22, size, false), &blocks_of(&object), MIB)
        .await
        .unwrap_err();
    assert_eq!(status_kind(&status), "already_exists");
    wait_used(&client, stored).await;
    assert_eq!(lookup(&client, "k").await, Some(header));

    // An overwrite replaces it and says what it replaced.
    let result = client
        .put_blocks(committing("k", 23, size, true), &blocks_of(&object), MIB)
        .await
        .unwrap();
    let replaced: ObjectHeader = serde_json::from_value(result["replaced"].clone()).unwrap();
    assert_eq!(replaced, header);
    assert_eq!(lookup(&client, "k").await.unwrap().version, 23);
    client
        .action(
            "delete_prefix",
            json!({"ctx": ctx("job-a", 1), "bucket": "b", "prefix": "k"}),
        )
        .await
        .unwrap();
    for version in [21u64, 23] {
        client
            .action(
                "delete_blocks",
                json!({"ctx": ctx("job-a", 1), "bucket": "b", "key": "k",
                       "version": version, "blocks": [1, 2, 3]}),
            )
            .await
            .unwrap();
    }
    wait_used(&client, baseline).await;

    // A block missing, a block of the wrong length, more than the tier holds: refused, and
    // neither the manifest nor any block remains.
    let mut missing = blocks_of(&object);
    missing.remove(1);
    let mut short = blocks_of(&object);
    short[0].1 = short[0].1.slice(..MIB - 1);
    let big = pattern(20 * MIB, 4);
    for (key, blocks, size, kind) in [
        ("missing", missing, size, "invalid_argument"),
        ("short", short, size, "invalid_argument"),
        ("full", blocks_of(&big), 20 * MIB, "capacity_exhausted"),
    ] {
        let status = client
            .put_blocks(committing(key, 30, size, false), &blocks, MIB)
            .await
            .unwrap_err();
        assert_eq!(status_kind(&status), kind, "{key}");
        assert_eq!(lookup(&client, key).await, None, "{key}");
        wait_used(&client, baseline).await;
    }
    // A commit of a small object is malformed: small objects are records.
    let status = client
        .put_blocks(
            committing("small", 31, 1000, false),
            &[(1, pattern(1000, 5))],
            MIB,
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
}

#[tokio::test]
async fn a_commit_after_the_map_changed_mid_upload_is_stale_and_leaves_nothing() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let baseline = used_bytes(&client).await;
    let object = pattern(2 * MIB, 6);
    let mut descriptor = committing("k", 40, 2 * MIB, false);
    descriptor["ctx"] = ctx("job-a", 1);
    let messages = put_messages(descriptor, &blocks_of(&object), MIB);
    let (tx, rx) = mpsc::channel::<FlightData>(1);
    let mut inner = client.inner.clone();
    let upload = tokio::spawn(async move { inner.do_put(ReceiverStream::new(rx)).await });
    let mut messages = messages.into_iter();
    for message in messages.by_ref().take(2) {
        tx.send(message).await.unwrap();
    }
    // Block 1 is taken (the upload began) under epoch 1; then the job moves to epoch 2.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while used_bytes(&client).await < baseline + MIB as u64 {
        assert!(
            std::time::Instant::now() < deadline,
            "block 1 never arrived"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    client
        .action(
            "set_epoch",
            json!({"ctx": admin_ctx(), "job": "job-a", "epoch": 2, "map": {"epoch": 2}}),
        )
        .await
        .unwrap();
    for message in messages {
        tx.send(message).await.unwrap();
    }
    drop(tx);
    let status = match upload.await.unwrap() {
        Ok(response) => response.into_inner().next().await.unwrap().unwrap_err(),
        Err(status) => status,
    };
    assert_eq!(
        (status.code(), status_kind(&status)),
        (Code::FailedPrecondition, "stale_epoch".into())
    );
    assert_eq!(lookup_at(&client, "k", 2).await, None);
    wait_used(&client, baseline).await;
}
