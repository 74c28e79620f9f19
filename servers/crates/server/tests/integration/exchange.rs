//! DoExchange sessions: pipelined small ops, flags, per-op errors, malformed frames, epochs.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use pocketflow_protocol::frame::{
    encode_request_frame, OpCode, OP_FLAG_DELETE, OP_FLAG_OVERWRITE, OP_FLAG_PERSIST,
};
use pocketflow_protocol::token::{now_unix_ms, TokenKey};
use pocketflow_protocol::{ObjectHeader, HEADER_FLAG_PERSIST};
use serde_json::json;
use tonic::Code;

use crate::harness::*;

#[tokio::test]
async fn pipelined_small_ops_with_many_in_flight() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();

    // 256 puts in 4 frames sent back to back, so at least 64 are in flight at once.
    let values: Vec<Bytes> = (0..256).map(|i| pattern(100 + i * 50, i as u64)).collect();
    for chunk in 0..4u64 {
        let ops: Vec<_> = (chunk * 64..chunk * 64 + 64)
            .map(|i| put(i, "b", &format!("k{i}"), values[i as usize].clone(), 0))
            .collect();
        session.send(1, &ops).await;
    }
    let replies = session.collect(256).await;
    assert!(
        replies
            .values()
            .all(|r| r.status == 0 && r.header.is_none()),
        "all puts succeed"
    );

    // 200 gets in one frame; replies may come in any order and share frames.
    let gets: Vec<_> = (0..200)
        .map(|i| simple(1000 + i, OpCode::Get, "b", &format!("k{i}"), 0))
        .collect();
    session.send(1, &gets).await;
    let mut frames = 0;
    let mut replies = HashMap::new();
    while replies.len() < 200 {
        frames += 1;
        for reply in session.next_replies().await.unwrap().unwrap() {
            replies.insert(reply.request_id, reply);
        }
    }
    assert!(frames <= 200);
    for i in 0..200u64 {
        let reply = &replies[&(1000 + i)];
        assert_eq!(reply.status, 0);
        assert_eq!(reply.body, values[i as usize]);
        let header = reply.header.expect("GET carries the header");
        assert_eq!(header.version, i + 1);
        assert_eq!(header.size, values[i as usize].len() as u64);
    }

    let replies = session
        .run(
            1,
            &[
                simple(1, OpCode::Lookup, "b", "k7", 0),
                simple(2, OpCode::Delete, "b", "k8", 0),
            ],
        )
        .await;
    assert_eq!(replies[&1].header.unwrap().size, values[7].len() as u64);
    assert_eq!(replies[&2].header.unwrap().version, 9);
    let replies = session
        .run(
            1,
            &[
                simple(3, OpCode::Get, "b", "k8", 0),
                simple(4, OpCode::Lookup, "b", "k8", 0),
            ],
        )
        .await;
    assert_eq!(
        (replies[&3].status, reply_kind(&replies[&3])),
        (5, "not_found".into())
    );
    assert_eq!(replies[&4].status, 5);

    // Half-closing the request stream ends the session cleanly.
    drop(session.tx);
    assert!(session.rx.message().await.unwrap().is_none());
}

#[tokio::test]
async fn first_frame_may_ride_on_the_descriptor() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let frame = encode_request_frame(1, &[put(1, "b", "k", Bytes::from_static(b"v"), 0)]);
    let descriptor = json!({"ctx": ctx("job-a", 1)}).to_string();
    let mut session = Session::open(&client, descriptor.into(), Some(frame))
        .await
        .unwrap();
    let replies = session.collect(1).await;
    assert_eq!(replies[&1].status, 0);
    let replies = session.run(1, &[simple(2, OpCode::Get, "b", "k", 0)]).await;
    assert_eq!(&replies[&2].body[..], b"v");
}

#[tokio::test]
async fn write_once_unless_overwrite() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    let replies = session
        .run(1, &[put(1, "b", "k", Bytes::from_static(b"one"), 0)])
        .await;
    assert_eq!(replies[&1].status, 0);
    let replies = session
        .run(1, &[put(2, "b", "k", Bytes::from_static(b"two"), 0)])
        .await;
    assert_eq!(
        (replies[&2].status, reply_kind(&replies[&2])),
        (6, "already_exists".into())
    );
    let replies = session
        .run(
            1,
            &[put(
                3,
                "b",
                "k",
                Bytes::from_static(b"three"),
                OP_FLAG_OVERWRITE,
            )],
        )
        .await;
    assert_eq!(replies[&3].status, 0);
    assert_eq!(replies[&3].header.expect("replaced header").version, 2);
    let replies = session.run(1, &[simple(4, OpCode::Get, "b", "k", 0)]).await;
    assert_eq!(&replies[&4].body[..], b"three");
}

#[tokio::test]
async fn persist_needs_a_long_running_server() {
    let short = TestServer::start(ServerOptions::default());
    let client = short.client().await;
    client.create_bucket("job-a", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    let replies = session
        .run(
            1,
            &[put(1, "b", "k", Bytes::from_static(b"p"), OP_FLAG_PERSIST)],
        )
        .await;
    assert_eq!(
        (replies[&1].status, reply_kind(&replies[&1])),
        (9, "persist_refused".into())
    );
    let status = client
        .put_blocks(
            put_descriptor("job-a", "b", "k", 5, 1024, true),
            &[(1, pattern(1024, 1))],
            1024,
        )
        .await
        .unwrap_err();
    assert_eq!(
        (status.code(), status_kind(&status)),
        (Code::FailedPrecondition, "persist_refused".into())
    );

    let long = TestServer::start(ServerOptions {
        long_running: true,
        ..Default::default()
    });
    let client = long.client().await;
    client.create_bucket("job-a", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    put_kept_and_gone_then_delete_job(&client, &mut session, 1024).await;
    let replies = session
        .run(
            1,
            &[
                simple(3, OpCode::Get, "b", "kept", 0),
                simple(4, OpCode::Get, "b", "gone", 0),
            ],
        )
        .await;
    assert_eq!(replies[&3].status, 0);
    assert_eq!(replies[&3].header.unwrap().flags, HEADER_FLAG_PERSIST);
    assert_eq!(replies[&4].status, 5);
}

#[tokio::test]
async fn delete_on_read_hands_out_each_object_once() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let before = client.stats().await["used_bytes"].as_u64().unwrap();
    let mut writer = client.session("job-a", 1).await.unwrap();
    let keys = 64u64;
    let ops: Vec<_> = (0..keys)
        .map(|i| put(i, "b", &format!("k{i}"), pattern(4096, i), 0))
        .collect();
    assert!(writer.run(1, &ops).await.values().all(|r| r.status == 0));

    let mut readers = Vec::new();
    for reader in 0..4 {
        let client = server.client().await;
        readers.push(tokio::spawn(async move {
            let mut session = client.session("job-a", 1).await.unwrap();
            let ops: Vec<_> = (0..keys)
                .map(|i| simple(i, OpCode::Get, "b", &format!("k{i}"), OP_FLAG_DELETE))
                .collect();
            let replies = session.run(1, &ops).await;
            let _ = reader;
            replies
                .into_values()
                .filter(|r| r.status == 0)
                .map(|r| (r.request_id, r.body))
                .collect::<Vec<_>>()
        }));
    }
    let mut winners: HashMap<u64, usize> = HashMap::new();
    for reader in readers {
        for (id, body) in reader.await.unwrap() {
            assert_eq!(body, pattern(4096, id));
            *winners.entry(id).or_default() += 1;
        }
    }
    assert_eq!(winners.len(), keys as usize);
    assert!(
        winners.values().all(|n| *n == 1),
        "exactly one reader per object: {winners:?}"
    );
    // The space is freed once the readers' bytes were handed to the transport.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let used = client.stats().await["used_bytes"].as_u64().unwrap();
        if used == before {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "used_bytes {used} never returned to {before}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn failing_ops_fail_alone_and_malformed_frames_end_the_session() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    let mut bad_header = put(1, "b", "k1", Bytes::from_static(b"abc"), 0);
    bad_header.header.version = 0;
    let mut wrong_size = put(2, "b", "k2", Bytes::from_static(b"abc"), 0);
    wrong_size.header.size = 2;
    let manifest_with_value = {
        let mut op = manifest(
            3,
            "b",
            "k3",
            ObjectHeader {
                version: 3,
                size: 100_000,
                block_count: 1,
                block_size: 100_000,
                flags: 0,
            },
            0,
        );
        op.value = Bytes::from_static(b"x");
        op
    };
    let ops = [
        bad_header,
        wrong_size,
        manifest_with_value,
        simple(4, OpCode::Get, "b", "missing", 0),
        put(5, "nobucket", "k", Bytes::from_static(b"v"), 0),
        put(6, "b", "ok", Bytes::from_static(b"v"), 0),
    ];
    let replies = session.run(1, &ops).await;
    let got: Vec<(u8, String)> = (1..=6)
        .map(|i| (replies[&i].status, reply_kind(&replies[&i])))
        .collect();
    assert_eq!(got[0], (3, "invalid_argument".into()));
    assert_eq!(got[1], (3, "invalid_argument".into()));
    assert_eq!(got[2], (3, "invalid_argument".into()));
    assert_eq!(got[3], (5, "not_found".into()));
    assert_eq!(got[4], (5, "bucket_not_found".into()));
    assert_eq!(replies[&6].status, 0);

    session
        .send_raw(Bytes::from_static(b"\x01\x00\x00\x00garbage"))
        .await;
    let status = loop {
        match session
            .next_replies()
            .await
            .expect("a status ends the stream")
        {
            Ok(_) => continue,
            Err(status) => break status,
        }
    };
    assert_eq!(
        (status.code(), status_kind(&status)),
        (Code::InvalidArgument, "invalid_argument".into())
    );
    let mut again = client.session("job-a", 1).await.unwrap();
    assert_eq!(
        again.run(1, &[simple(7, OpCode::Get, "b", "ok", 0)]).await[&7].status,
        0
    );
}

#[tokio::test]
async fn stale_epochs_get_the_new_map() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let mut session = client.session("job-a", 1).await.unwrap();
    let map = json!({"epoch": 5, "servers": [{"address": "127.0.0.1:1", "weight": 1.0}]});
    client
        .action(
            "set_epoch",
            json!({"ctx": admin_ctx(), "job": "job-a", "epoch": 5, "map": map}),
        )
        .await
        .unwrap();

    let replies = session
        .run(
            4,
            &[
                put(1, "b", "k", Bytes::from_static(b"v"), 0),
                simple(2, OpCode::Get, "b", "k", 0),
            ],
        )
        .await;
    for reply in replies.values() {
        assert_eq!(reply.status, 9);
        let text = std::str::from_utf8(&reply.body).unwrap();
        let map_text = text.strip_prefix("stale_epoch: ").expect("kind prefix");
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(map_text).unwrap(),
            map
        );
    }
    assert_eq!(
        session
            .run(5, &[put(3, "b", "k", Bytes::from_static(b"v"), 0)])
            .await[&3]
            .status,
        0
    );
    assert_eq!(
        session.run(6, &[simple(4, OpCode::Get, "b", "k", 0)]).await[&4].status,
        0
    );

    let status = client
        .session("job-a", 4)
        .await
        .err()
        .expect("stale session refused");
    assert_eq!(status.code(), Code::FailedPrecondition);
    let status = client
        .action(
            "lookup",
            json!({"ctx": ctx("job-a", 1), "bucket": "b", "key": "k"}),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    let map_text = status.message().strip_prefix("stale_epoch: ").unwrap();
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(map_text).unwrap(),
        map
    );
    // Another job is not affected, and epochs never move backwards.
    client.create_bucket("job-b", "b").await;
    let status = client
        .action(
            "set_epoch",
            json!({"ctx": admin_ctx(), "job": "job-a", "epoch": 3, "map": {}}),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
}

#[tokio::test]
async fn a_session_stops_when_its_token_expires() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let expiry_unix_ms = now_unix_ms() + 3_000;
    let token = TokenKey::new(SECRET).unwrap().make("job-a", expiry_unix_ms);
    let descriptor = json!({"ctx": {"job": "job-a", "epoch": 1, "token": token}});
    let mut session = Session::open(&client, descriptor.to_string().into(), None)
        .await
        .unwrap();
    let ops = [put(1, "b", "k", Bytes::from_static(b"v"), 0)];
    assert_eq!(session.run(1, &ops).await[&1].status, 0);

    // The session ends by itself at the expiry, though idle (a client holding a renewed token
    // then replaces it before its next call instead of losing that call).
    let status = tokio::time::timeout(Duration::from_secs(10), session.next_replies())
        .await
        .expect("the session ends within the bound")
        .expect("a status ends the stream")
        .expect_err("no reply after the token expired");
    assert!(now_unix_ms() >= expiry_unix_ms, "ended before the expiry");
    assert_eq!(
        (status.code(), status_kind(&status)),
        (Code::PermissionDenied, "permission_denied".into())
    );
    assert!(status.message().contains("expired"), "{}", status.message());
    // A fresh token still works, and the object is there.
    let mut again = client.session("job-a", 1).await.unwrap();
    assert_eq!(
        again.run(1, &[simple(3, OpCode::Get, "b", "k", 0)]).await[&3].status,
        0
    );
}

/// A message over the 16 MiB message bound (refused by the decoder, not the peer) ends the
/// session with a status the client can read, not with a silent OK end.
#[tokio::test]
async fn an_over_limit_message_gets_a_status() {
    use arrow_flight::{FlightData, FlightDescriptor};
    use futures::StreamExt;

    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let descriptor = json!({"ctx": ctx("job-a", 1)}).to_string();
    let first = FlightData {
        flight_descriptor: Some(FlightDescriptor::new_cmd(descriptor)),
        ..Default::default()
    };
    let huge = FlightData {
        app_metadata: Bytes::from(vec![0u8; 17 << 20]),
        ..Default::default()
    };
    let mut inner = client.inner.clone().max_encoding_message_size(64 << 20);
    let response = inner
        .do_exchange(futures::stream::iter(vec![first, huge]))
        .await
        .expect("the session opens");
    let mut stream = response.into_inner();
    let mut status = None;
    while let Ok(Some(message)) = tokio::time::timeout(Duration::from_secs(10), stream.next()).await
    {
        if let Err(s) = message {
            status = Some(s);
            break;
        }
    }
    let status = status.expect("the session ended with a status, not silently");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().starts_with("invalid_argument: "),
        "{status:?}"
    );
    // The server keeps serving.
    let mut session = client.session("job-a", 1).await.unwrap();
    let replies = session
        .run(1, &[put(1, "b", "after", Bytes::from_static(b"v"), 0)])
        .await;
    assert_eq!(replies[&1].status, 0);
}
