//! The client core against a real storage service on 127.0.0.1:0 (in this process, on its own
//! runtime, Flight and the direct exchange on one port as in the server binary): small ops over
//! both session kinds, pipelining, blocks, actions, errors.

use std::time::Duration;

use bytes::Bytes;
use pocketflow_client::{
    block_on, split_dest, BlockSlice, ClientError, Connection, ConnectionConfig, ExchangeRequest,
    RangeTarget,
};
use pocketflow_flight::route::route;
use pocketflow_flight::{ServiceConfig, StorageService};
use pocketflow_protocol::frame::OpCode;
use pocketflow_protocol::header::ObjectHeader;
use pocketflow_protocol::limits::ADMIN_JOB_ID;
use pocketflow_protocol::token::{now_unix_ms, TokenKey};
use pocketflow_store::{Store, StoreConfig, Tier};

const SECRET: &[u8] = b"a test secret of enough bytes";
const JOB: &str = "job-client-core";

/// Start a DRAM server in a thread of its own; returns its address.
fn start_server() -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().expect("server runtime");
        runtime.block_on(async move {
            let store = Store::open(StoreConfig {
                tier: Tier::Dram,
                capacity_bytes: 64 << 20,
                nvme_path: None,
                long_running: true,
                persist_ttl: None,
                shared_dram: false,
            })
            .expect("store");
            let service = StorageService::new(
                store,
                ServiceConfig {
                    node_id: "dram-test".into(),
                    token_key: TokenKey::new(SECRET).expect("key"),
                    transfer_idle: Duration::from_secs(30),
                },
            );
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap().to_string()).unwrap();
            tonic::transport::Server::builder()
                .add_service(service.clone().into_server())
                .serve_with_incoming(route(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    service.clone(),
                    None,
                ))
                .await
                .unwrap();
        });
    });
    let address = rx.recv().expect("server address");
    register(&address);
    address
}

/// Register `JOB` on the server as the control plane does (`set_epoch`): only a registered
/// job writes.
fn register(address: &str) {
    let admin = TokenKey::new(SECRET)
        .unwrap()
        .make(ADMIN_JOB_ID, now_unix_ms() + 600_000);
    let body = serde_json::json!({
        "ctx": {"job": ADMIN_JOB_ID, "epoch": 0, "token": admin},
        "job": JOB, "epoch": 1, "map": {"epoch": 1},
    });
    let connection = Connection::new(address, ConnectionConfig::default()).unwrap();
    block_on(connection.action("set_epoch", Bytes::from(body.to_string()))).unwrap();
}

fn token() -> String {
    TokenKey::new(SECRET)
        .unwrap()
        .make(JOB, now_unix_ms() + 600_000)
}

fn ctx_json(token: &str) -> serde_json::Value {
    serde_json::json!({"job": JOB, "epoch": 1, "token": token})
}

fn command(token: &str) -> Bytes {
    Bytes::from(serde_json::to_vec(&serde_json::json!({"ctx": ctx_json(token)})).unwrap())
}

fn connection(address: &str) -> Connection {
    Connection::new(
        address,
        ConnectionConfig {
            op_timeout: Duration::from_secs(5),
            ..ConnectionConfig::default()
        },
    )
    .unwrap()
}

fn small_put(key: &str, value: &'static [u8]) -> ExchangeRequest {
    ExchangeRequest {
        op: OpCode::Put,
        flags: 0,
        bucket: "b".into(),
        key: key.into(),
        header: ObjectHeader {
            version: 7,
            size: value.len() as u64,
            ..Default::default()
        },
        value: Bytes::from_static(value),
    }
}

fn get(key: &str) -> ExchangeRequest {
    ExchangeRequest {
        op: OpCode::Get,
        flags: 0,
        bucket: "b".into(),
        key: key.into(),
        header: ObjectHeader::default(),
        value: Bytes::new(),
    }
}

fn create_bucket(conn: &Connection, token: &str) {
    let body = serde_json::json!({"ctx": ctx_json(token), "bucket": "b"});
    block_on(conn.action("create_bucket", Bytes::from(body.to_string()))).unwrap();
}

#[test]
fn small_ops_round_trip_and_pipeline() {
    let address = start_server();
    let conn = connection(&address);
    let token = token();
    create_bucket(&conn, &token);
    let cmd = command(&token);
    let put = block_on(conn.exchange(&cmd, 1, &[small_put("k", b"hello")], 1)).unwrap();
    assert_eq!(put[0].status, 0);
    let got = block_on(conn.exchange(&cmd, 1, &[get("k"), get("absent")], 8)).unwrap();
    assert_eq!((got[0].status, &got[0].body[..]), (0, &b"hello"[..]));
    assert_eq!(got[0].header.unwrap().size, 5);
    assert_eq!(got[1].status, 5);
    assert!(got[1].body.starts_with(b"not_found: "));

    // More ops than a frame and a window hold: replies come back in request order.
    let puts: Vec<_> = (0..1500)
        .map(|i| small_put(&format!("p{i}"), b"v"))
        .collect();
    let replies = block_on(conn.exchange(&cmd, 1, &puts, 200)).unwrap();
    assert!(replies.iter().all(|r| r.status == 0));
    let gets: Vec<_> = (0..1500).map(|i| get(&format!("p{i}"))).collect();
    let replies = block_on(conn.exchange(&cmd, 1, &gets, 64)).unwrap();
    assert_eq!(replies.len(), 1500);
    assert!(replies.iter().all(|r| r.status == 0 && &r.body[..] == b"v"));

    // A bad op fails alone in its frame: a value whose length disagrees with its header.
    let mut bad = small_put("bad", b"xxxxx");
    bad.header.size = 3;
    let replies = block_on(conn.exchange(&cmd, 1, &[bad, small_put("ok", b"xyz")], 8)).unwrap();
    assert_eq!((replies[0].status, replies[1].status), (3, 0));
}

#[test]
fn blocks_round_trip_into_the_callers_memory_over_doget() {
    blocks_round_trip(false);
}

#[test]
fn blocks_round_trip_into_the_callers_memory_over_a_direct_connection() {
    blocks_round_trip(true);
}

fn blocks_round_trip(direct: bool) {
    let address = start_server();
    let conn = Connection::new(
        &address,
        ConnectionConfig {
            op_timeout: Duration::from_secs(5),
            direct,
            ..ConnectionConfig::default()
        },
    )
    .unwrap();
    let token = token();
    create_bucket(&conn, &token);
    let block_size = 1usize << 20;
    let data: Vec<u8> = (0..(2 * block_size + 1234))
        .map(|i| (i * 31 % 251) as u8)
        .collect();
    let blocks: Vec<BlockSlice<'_>> = data
        .chunks(block_size)
        .enumerate()
        .map(|(i, chunk)| BlockSlice {
            index: i as u32 + 1,
            data: chunk,
        })
        .collect();
    let descriptor = serde_json::json!({"ctx": ctx_json(&token), "bucket": "b", "key": "big",
        "version": 9, "block_size": block_size, "persist": false});
    let result = conn
        .put_blocks_blocking(Bytes::from(descriptor.to_string()), &blocks)
        .unwrap();
    let result: serde_json::Value = serde_json::from_slice(&result).unwrap();
    assert_eq!(result["blocks"], 3);
    assert_eq!(result["bytes"], data.len());

    // An upload larger than the tier (64 MiB) is refused with a typed error while its pieces
    // are still going out; nothing of it stays, and the connection pool keeps working.
    let huge = vec![7u8; 80 << 20];
    let huge_blocks: Vec<BlockSlice<'_>> = huge
        .chunks(block_size)
        .enumerate()
        .map(|(i, chunk)| BlockSlice {
            index: i as u32 + 1,
            data: chunk,
        })
        .collect();
    let descriptor_huge = serde_json::json!({"ctx": ctx_json(&token), "bucket": "b",
        "key": "huge", "version": 3, "block_size": block_size, "persist": false});
    let err = conn
        .put_blocks_blocking(Bytes::from(descriptor_huge.to_string()), &huge_blocks)
        .unwrap_err();
    assert_eq!(err.code(), 8, "{err}");
    assert!(err.to_string().starts_with("capacity_exhausted: "), "{err}");
    let again = conn
        .put_blocks_blocking(Bytes::from(descriptor_huge.to_string()), &huge_blocks[..2])
        .unwrap();
    let again: serde_json::Value = serde_json::from_slice(&again).unwrap();
    assert_eq!(again["blocks"], 2, "the refused upload's blocks were freed");

    // Every block whole, then a range inside block 2, into one destination.
    let ranges = [
        RangeTarget {
            block: 1,
            offset: 0,
            len: block_size as u64,
            dest_at: 0,
        },
        RangeTarget {
            block: 2,
            offset: 0,
            len: block_size as u64,
            dest_at: block_size,
        },
        RangeTarget {
            block: 3,
            offset: 0,
            len: 1234,
            dest_at: 2 * block_size,
        },
    ];
    let ticket = serde_json::json!({"ctx": ctx_json(&token), "bucket": "b", "key": "big",
        "version": 9, "ranges": [[1, 0, block_size], [2, 0, block_size], [3, 0, 1234]],
        "delete": false});
    // Twice: the second read reuses the pooled connection.
    let refs: Vec<&RangeTarget> = ranges.iter().collect();
    for _ in 0..2 {
        let mut dest = vec![0u8; data.len()];
        let mut dests = split_dest(&mut dest, &refs).unwrap();
        let outcome = conn
            .get_ranges_blocking(Bytes::from(ticket.to_string()), &ranges, &mut dests)
            .unwrap();
        assert!(outcome.error.is_none());
        assert_eq!(
            outcome.received,
            vec![block_size as u64, block_size as u64, 1234]
        );
        assert!(dest == data);
    }

    // A missing block: the ranges before it are counted, the error says not_found.
    let ticket = serde_json::json!({"ctx": ctx_json(&token), "bucket": "b", "key": "big",
        "version": 9, "ranges": [[1, 10, 100], [7, 0, 10]], "delete": false});
    let ranges = [
        RangeTarget {
            block: 1,
            offset: 10,
            len: 100,
            dest_at: 0,
        },
        RangeTarget {
            block: 7,
            offset: 0,
            len: 10,
            dest_at: 100,
        },
    ];
    let refs: Vec<&RangeTarget> = ranges.iter().collect();
    let mut dest = vec![0u8; 110];
    let mut dests = split_dest(&mut dest, &refs).unwrap();
    match conn.get_ranges_blocking(Bytes::from(ticket.to_string()), &ranges, &mut dests) {
        Ok(outcome) => {
            assert_eq!(outcome.received, vec![100, 0]);
            assert!(outcome.error.unwrap().is_not_found());
        }
        Err(error) => assert!(error.is_not_found(), "{error}"),
    }
    assert_eq!(&dest[..100], &data[10..110]);
    // A range that does not fit the destination is refused before anything is sent.
    let mut small = [0u8; 10];
    assert!(matches!(
        split_dest(&mut small, &refs),
        Err(ClientError::InvalidArgument(_))
    ));
    let err = conn
        .get_ranges_blocking(Bytes::new(), &ranges, &mut [&mut small[..]])
        .unwrap_err();
    assert!(matches!(err, ClientError::InvalidArgument(_)));
    // A forged token: refused before any byte, typed.
    let forged = TokenKey::new(b"another secret, also long")
        .unwrap()
        .make(JOB, now_unix_ms() + 600_000);
    let ticket = serde_json::json!({"ctx": ctx_json(&forged), "bucket": "b", "key": "big",
        "version": 9, "ranges": [[1, 10, 100]], "delete": false});
    let err = conn
        .get_ranges_blocking(
            Bytes::from(ticket.to_string()),
            &ranges[..1],
            &mut [&mut dest[..100]],
        )
        .unwrap_err();
    assert_eq!(err.code(), 7, "{err}");
    // After failures, reads work again (a fresh connection replaces the closed one).
    let ticket = serde_json::json!({"ctx": ctx_json(&token), "bucket": "b", "key": "big",
        "version": 9, "ranges": [[3, 0, 1234]], "delete": true});
    let mut tail = vec![0u8; 1234];
    let outcome = conn
        .get_ranges_blocking(
            Bytes::from(ticket.to_string()),
            &[RangeTarget {
                block: 3,
                offset: 0,
                len: 1234,
                dest_at: 0,
            }],
            &mut [&mut tail[..]],
        )
        .unwrap();
    assert_eq!(outcome.received, vec![1234]);
    assert_eq!(&tail[..], &data[2 * block_size..]);
    // Read with delete: the block is gone afterwards.
    let again = conn.get_ranges_blocking(
        Bytes::from(ticket.to_string()),
        &[RangeTarget {
            block: 3,
            offset: 0,
            len: 1234,
            dest_at: 0,
        }],
        &mut [&mut tail[..]],
    );
    assert!(again.unwrap_err().is_not_found());
}

#[test]
fn errors_are_typed() {
    let address = start_server();
    let conn = connection(&address);
    let forged = TokenKey::new(b"another secret, also long")
        .unwrap()
        .make(JOB, now_unix_ms() + 600_000);
    let err = block_on(conn.exchange(&command(&forged), 1, &[get("k")], 1)).unwrap_err();
    assert_eq!(err.code(), 7, "{err}");
    assert!(err.to_string().starts_with("permission_denied: "));

    // Nobody listens: unavailable within the connect bound, not a hang.
    let dead = Connection::new(
        "127.0.0.1:1",
        ConnectionConfig {
            first_reply_timeout: Duration::from_millis(500),
            ..ConnectionConfig::default()
        },
    )
    .unwrap();
    let started = std::time::Instant::now();
    let err = block_on(dead.exchange(&command(&token()), 1, &[get("k")], 1)).unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let err = block_on(dead.action("stats", Bytes::from_static(b"{}"))).unwrap_err();
    assert!(err.is_unavailable(), "{err}");
}

/// Small ops over direct-exchange sessions: the same replies as over DoExchange, in order, with
/// more ops than a frame and a window hold, and sessions reused across calls.
#[test]
fn direct_sessions_run_small_ops() {
    let address = start_server();
    let conn = connection(&address);
    let token = token();
    create_bucket(&conn, &token);
    let cmd = command(&token);
    let put = conn
        .exchange_blocking(&cmd, 1, &[small_put("d", b"direct")], 1)
        .unwrap();
    assert_eq!(put[0].status, 0);
    // Written directly, read over DoExchange, and the other way round.
    let got = block_on(conn.exchange(&cmd, 1, &[get("d")], 1)).unwrap();
    assert_eq!(&got[0].body[..], b"direct");
    block_on(conn.exchange(&cmd, 1, &[small_put("f", b"flight")], 1)).unwrap();
    let got = conn
        .exchange_blocking(
            &cmd,
            1,
            &[get("f"), get("absent"), small_put("d", b"again")],
            4,
        )
        .unwrap();
    assert_eq!((got[0].status, &got[0].body[..]), (0, &b"flight"[..]));
    assert_eq!(got[1].status, 5);
    assert!(got[1].body.starts_with(b"not_found: "));
    assert_eq!(
        got[2].status, 6,
        "write-once holds over the direct exchange too"
    );

    let puts: Vec<_> = (0..1500)
        .map(|i| small_put(&format!("q{i}"), b"w"))
        .collect();
    let replies = conn.exchange_blocking(&cmd, 1, &puts, 200).unwrap();
    assert!(replies.iter().all(|r| r.status == 0));
    let gets: Vec<_> = (0..1500).map(|i| get(&format!("q{i}"))).collect();
    for _ in 0..3 {
        let replies = conn.exchange_blocking(&cmd, 1, &gets, 64).unwrap();
        assert_eq!(replies.len(), 1500);
        assert!(replies.iter().all(|r| r.status == 0 && &r.body[..] == b"w"));
    }
    assert_eq!(conn.warm_blocking(&cmd, 3).unwrap(), 3);

    // Threads share the pool: each gets its own session, every reply is its own.
    std::thread::scope(|scope| {
        for t in 0..6 {
            let (conn, cmd) = (&conn, &cmd);
            scope.spawn(move || {
                for i in 0..200 {
                    let key = format!("q{}", (t * 200 + i) % 1500);
                    let r = conn.exchange_blocking(cmd, 1, &[get(&key)], 1).unwrap();
                    assert_eq!(&r[0].body[..], b"w");
                }
            });
        }
    });
}

#[test]
fn direct_sessions_fail_typed() {
    let address = start_server();
    let conn = connection(&address);
    let forged = TokenKey::new(b"another secret, also long")
        .unwrap()
        .make(JOB, now_unix_ms() + 600_000);
    let err = conn
        .exchange_blocking(&command(&forged), 1, &[get("k")], 1)
        .unwrap_err();
    assert_eq!(err.code(), 7, "{err}");
    assert!(err.to_string().starts_with("permission_denied: "), "{err}");
    let err = conn
        .exchange_blocking(&Bytes::from_static(b"{not json"), 1, &[get("k")], 1)
        .unwrap_err();
    assert_eq!(err.code(), 3, "{err}");

    let dead = Connection::new(
        "127.0.0.1:1",
        ConnectionConfig {
            first_reply_timeout: Duration::from_millis(500),
            ..ConnectionConfig::default()
        },
    )
    .unwrap();
    let err = dead
        .exchange_blocking(&command(&token()), 1, &[get("k")], 1)
        .unwrap_err();
    assert!(err.is_unavailable(), "{err}");
}

/// Raw bytes on the port: a malformed direct message gets a status it can read, then the close.
#[test]
fn a_malformed_direct_message_gets_a_status() {
    use pocketflow_protocol::direct::{decode_head, decode_status, encode_message, Kind};
    use std::io::{Read, Write};
    let address = start_server();
    let read_status = |stream: &mut std::net::TcpStream| {
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut head = [0u8; 5];
        stream.read_exact(&mut head).unwrap();
        let (kind, len) = decode_head(&head).unwrap();
        let mut payload = vec![0u8; len];
        stream.read_exact(&mut payload).unwrap();
        assert_eq!(kind, Kind::Status);
        let status = decode_status(&payload).unwrap();
        let mut rest = Vec::new();
        assert_eq!(stream.read_to_end(&mut rest).unwrap(), 0, "closed after it");
        status
    };
    // An unknown message kind (42) after the magic.
    let mut stream = std::net::TcpStream::connect(&address).unwrap();
    stream.write_all(b"PFXCHG01\x2a\0\0\0\0").unwrap();
    let (code, message) = read_status(&mut stream);
    assert_eq!(code, 3, "{message}");
    assert!(message.starts_with("invalid_argument: "), "{message}");
    // A frame over the bound, announced in the head of a request frame after a good open.
    let mut stream = std::net::TcpStream::connect(&address).unwrap();
    stream.write_all(b"PFXCHG01").unwrap();
    stream
        .write_all(&encode_message(Kind::Open, &command(&token())))
        .unwrap();
    let mut ready = [0u8; 5];
    stream.read_exact(&mut ready).unwrap();
    assert_eq!(decode_head(&ready).unwrap(), (Kind::Ready, 0));
    let mut over = vec![Kind::Frame.code()];
    over.extend_from_slice(&(17u32 << 20).to_le_bytes());
    stream.write_all(&over).unwrap();
    let (code, message) = read_status(&mut stream);
    assert_eq!(code, 3, "{message}");
}
