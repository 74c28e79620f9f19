//! The object layer of the client core (`Objects`, `Listing`) against three real storage
//! services on 127.0.0.1:0 (in this process, each on its own runtime, as in the server binary):
//! small and striped objects, DELETE reads, batches, write-once across placements, overwrites,
//! a listing merged from every server, a stale map adopted mid-call, waits for keys, keys
//! routed by prefix to a pool of the map, where data blocks live (an object of one data block
//! whole on its manifest's server, larger ones striped), the direct READ that brings a
//! record and its bytes in one answer, and a channel segment's ops run pipelined across a map
//! change and a server that lacks the bucket.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pocketflow_client::channels::PLACED_OPS_MAX;
use pocketflow_client::objects::Tuning;
use pocketflow_client::view::View;
use pocketflow_client::waits::Stop;
use pocketflow_client::{
    block_on, BlockSlice, ClientError, Connection, ConnectionConfig, Destination, ExchangeRequest,
    Listing, Objects, RangeTarget, StreamUpload,
};
use pocketflow_flight::route::route;
use pocketflow_flight::{ServiceConfig, StorageService};
use pocketflow_protocol::frame::OpCode;
use pocketflow_protocol::header::ObjectHeader;
use pocketflow_protocol::limits::{ADMIN_JOB_ID, FRAME_MAX_BYTES};
use pocketflow_protocol::token::{now_unix_ms, TokenKey};
use pocketflow_store::{Store, StoreConfig, Tier};

const SECRET: &[u8] = b"a test secret of enough bytes";
const MIB: usize = 1 << 20;
const BLOCK_SIZE: u32 = 256 * 1024;

/// Start a DRAM service in a thread of its own; returns its address.
fn start_server(node_id: &'static str, long_running: bool) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().expect("server runtime");
        runtime.block_on(async move {
            let store = Store::open(StoreConfig {
                tier: Tier::Dram,
                capacity_bytes: 64 << 20,
                nvme_path: None,
                long_running,
                persist_ttl: None,
                shared_dram: false,
            })
            .expect("store");
            let service = StorageService::new(
                store,
                ServiceConfig {
                    node_id: node_id.into(),
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
    rx.recv().expect("server address")
}

struct Cluster {
    /// `(node id, address, long-running)`.
    servers: Vec<(&'static str, String, bool)>,
}

impl Cluster {
    /// dram-a (long-running), dram-b, dram-c (long-running).
    fn start() -> Cluster {
        let servers = [("dram-a", true), ("dram-b", false), ("dram-c", true)]
            .into_iter()
            .map(|(id, lr)| (id, start_server(id, lr), lr))
            .collect();
        Cluster { servers }
    }

    fn map(&self, epoch: u64, upto: usize) -> serde_json::Value {
        let rows: Vec<serde_json::Value> = self.servers[..upto]
            .iter()
            .map(|(id, address, lr)| serde_json::json!([id, address, "dram", 1, u8::from(*lr)]))
            .collect();
        serde_json::json!({"epoch": epoch, "servers": rows})
    }

    /// The handle of `job` over the first `upto` servers, the job registered on every server
    /// as the control plane does (`set_epoch`, epoch 1, unless a server holds a later one).
    fn handle(&self, job: &str, upto: usize) -> String {
        self.register(job, upto);
        let token = TokenKey::new(SECRET)
            .unwrap()
            .make(job, now_unix_ms() + 600_000);
        let mut handle = self.map(1, upto);
        handle["job"] = job.into();
        handle["name"] = "test".into();
        handle["token"] = token.into();
        handle["block_size"] = BLOCK_SIZE.into();
        handle.to_string()
    }

    /// Tell every server that `job` is at epoch 1 with the first `upto` servers, unless it holds
    /// a later epoch already: only a registered job writes.
    fn register(&self, job: &str, upto: usize) {
        let admin = TokenKey::new(SECRET)
            .unwrap()
            .make(ADMIN_JOB_ID, now_unix_ms() + 600_000);
        for (_, address, _) in &self.servers {
            let body = serde_json::json!({
                "ctx": {"job": ADMIN_JOB_ID, "epoch": 0, "token": admin},
                "job": job, "epoch": 1, "map": self.map(1, upto),
            });
            let connection = Connection::new(address, ConnectionConfig::default()).unwrap();
            if let Err(e) = block_on(connection.action("set_epoch", Bytes::from(body.to_string())))
            {
                assert!(e.to_string().starts_with("stale_epoch"), "set_epoch: {e}");
            }
        }
    }

    /// Tell every server that `job` is at `epoch` with the first `upto` servers.
    fn set_epoch(&self, job: &str, epoch: u64, upto: usize) {
        let admin = TokenKey::new(SECRET)
            .unwrap()
            .make(ADMIN_JOB_ID, now_unix_ms() + 600_000);
        for (_, address, _) in &self.servers {
            let body = serde_json::json!({
                "ctx": {"job": ADMIN_JOB_ID, "epoch": 0, "token": admin},
                "job": job, "epoch": epoch, "map": self.map(epoch, upto),
            });
            let connection = Connection::new(address, ConnectionConfig::default()).unwrap();
            block_on(connection.action("set_epoch", Bytes::from(body.to_string()))).unwrap();
        }
    }

    fn objects(&self, job: &str, upto: usize) -> Objects {
        let objects = client_of(&self.handle(job, upto));
        let view = objects.view();
        for server in &view.servers {
            let body = serde_json::json!({"ctx": &view.ctx, "bucket": "b"});
            let connection = objects.connection(&server.address).unwrap();
            block_on(connection.action("create_bucket", Bytes::from(body.to_string()))).unwrap();
        }
        objects
    }
}

/// Objects over `handle` (its buckets made elsewhere).
fn client_of(handle: &str) -> Objects {
    let config = ConnectionConfig {
        op_timeout: Duration::from_secs(5),
        ..ConnectionConfig::default()
    };
    let tuning = Tuning {
        io_threads: 4,
        exchange_window: 64,
    };
    Objects::new(handle, config, tuning).unwrap()
}

/// A destination that allocates what the read asks for.
#[derive(Default)]
struct Buffer(Vec<u8>);

impl Destination for Buffer {
    fn buffer(&mut self, size: usize) -> Result<&mut [u8], ClientError> {
        self.0 = vec![0; size];
        Ok(&mut self.0)
    }
}

fn get(objects: &Objects, key: &str, delete: bool) -> Result<Vec<u8>, ClientError> {
    let mut dest = Buffer::default();
    objects
        .get("b", key, delete, &mut dest)
        .map(|_| dest.0)
        .map_err(|f| f.error)
}

fn payload(size: usize, seed: u8) -> Vec<u8> {
    (0..size)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// The header and the server of `key`'s record (a LOOKUP where the object layer finds it).
fn record_of(objects: &Objects, key: &str) -> (ObjectHeader, String) {
    let record = objects
        .fetch_record("b", key, OpCode::Lookup, 0, true)
        .unwrap();
    (record.header.unwrap(), record.server)
}

/// Whether the server at `address` holds data block `block` of version `version` of `key`
/// (one byte of it read over a ticket of its own; `not_found` says no).
fn holds_block(objects: &Objects, address: &str, key: &str, version: u64, block: u32) -> bool {
    let view = objects.view();
    let ticket = serde_json::json!({"ctx": &view.ctx, "bucket": "b", "key": key,
        "version": version, "ranges": [[block, 0, 1]], "delete": false});
    let range = RangeTarget {
        block,
        offset: 0,
        len: 1,
        dest_at: 0,
    };
    let mut dest = [0u8; 1];
    let connection = objects.connection(address).unwrap();
    let ticket = Bytes::from(ticket.to_string());
    match connection.get_ranges_blocking(ticket, &[range], &mut [&mut dest[..]]) {
        Ok(outcome) => match outcome.error {
            None => true,
            Some(error) if error.is_not_found() => false,
            Some(error) => panic!("reading block {block} of {key} on {address}: {error}"),
        },
        Err(error) if error.is_not_found() => false,
        Err(error) => panic!("reading block {block} of {key} on {address}: {error}"),
    }
}

/// The addresses of the servers that hold data block `block` of `key`'s version `version`.
fn holders(objects: &Objects, key: &str, version: u64, block: u32) -> Vec<String> {
    objects
        .view()
        .servers
        .iter()
        .filter(|s| holds_block(objects, &s.address, key, version, block))
        .map(|s| s.address.clone())
        .collect()
}

fn kind(error: &ClientError) -> String {
    error
        .to_string()
        .split(": ")
        .next()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn objects_round_trip_small_and_striped() {
    let cluster = Cluster::start();
    let objects = cluster.objects("job-round-trip", 3);
    let small = payload(1000, 1);
    let large = payload(3 * MIB + 17, 2);
    objects.put("b", "small", &small, false, false).unwrap();
    objects.put("b", "large", &large, false, false).unwrap();
    assert_eq!(get(&objects, "small", false).unwrap(), small);
    assert_eq!(get(&objects, "large", false).unwrap(), large);

    // A range crossing block boundaries.
    let mut range = Buffer::default();
    let count = objects
        .get_range("b", "large", 250_000, 600_000, &mut range)
        .unwrap();
    assert_eq!(count, 600_000);
    assert_eq!(range.0, large[250_000..850_000]);

    // Write-once, and a DELETE read that only one reader gets.
    let again = objects.put("b", "large", &small, false, false).unwrap_err();
    assert_eq!(kind(&again.error), "already_exists");
    assert_eq!(get(&objects, "large", true).unwrap(), large);
    assert_eq!(
        kind(&get(&objects, "large", false).unwrap_err()),
        "not_found"
    );

    // An overwrite replaces the object whole.
    objects.put("b", "small", &large, false, true).unwrap();
    assert_eq!(get(&objects, "small", false).unwrap(), large);
}

#[test]
fn batches_store_and_read_every_object_and_report_the_missing_one() {
    let cluster = Cluster::start();
    let objects = cluster.objects("job-batches", 3);
    let values: Vec<Vec<u8>> = (0..40)
        .map(|i| payload(if i % 10 == 0 { MIB + i } else { 100 + i }, i as u8))
        .collect();
    let keys: Vec<String> = (0..40).map(|i| format!("k-{i:02}")).collect();
    let items: Vec<(&str, &[u8])> = keys
        .iter()
        .zip(&values)
        .map(|(k, v)| (k.as_str(), v.as_slice()))
        .collect();
    assert_eq!(objects.put_many("b", &items, false, false).unwrap(), 40);
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let records = objects.fetch_records("b", &key_refs, false);
    for (record, value) in records.iter().zip(&values) {
        assert_eq!(record.as_ref().unwrap().size(), value.len() as u64);
    }
    let mut with_missing = key_refs.clone();
    with_missing.insert(3, "absent");
    let records = objects.fetch_records("b", &with_missing, false);
    assert_eq!(kind(&records[3].as_ref().unwrap_err().error), "not_found");
    assert_eq!(records.iter().filter(|r| r.is_ok()).count(), 40);

    // The listing merges every server's keys in order, in pages.
    let mut listing = Listing::start(Arc::new(objects), "b", "k-", 7).unwrap();
    let mut listed = Vec::new();
    while let Some(page) = listing.next_page().unwrap() {
        assert!(page.len() <= 7);
        listed.extend(page);
    }
    let expected: Vec<(String, u64)> = keys
        .iter()
        .zip(&values)
        .map(|(k, v)| (k.clone(), v.len() as u64))
        .collect();
    assert_eq!(listed, expected);
}

#[test]
fn write_once_holds_across_the_persist_and_ephemeral_homes() {
    let cluster = Cluster::start();
    let objects = cluster.objects("job-rivals", 3);
    let view = objects.view();
    // A key whose ephemeral home is not its PERSIST home.
    let key = (0..1000)
        .map(|i| format!("rival-{i}"))
        .find(|k| {
            view.server_for(k.as_bytes(), 0, false).unwrap().node_id
                != view.server_for(k.as_bytes(), 0, true).unwrap().node_id
        })
        .expect("a key with two homes");
    objects.put("b", &key, b"first", false, false).unwrap();
    let lost = objects.put("b", &key, b"second", true, false).unwrap_err();
    assert_eq!(kind(&lost.error), "already_exists");
    // The losing PERSIST record was withdrawn: the first object is the one read.
    assert_eq!(get(&objects, &key, false).unwrap(), b"first");
    assert_eq!(get(&objects, &key, true).unwrap(), b"first");
    assert_eq!(kind(&get(&objects, &key, false).unwrap_err()), "not_found");
}

#[test]
fn routed_keys_live_on_their_pool_whole() {
    let cluster = Cluster::start();
    let job = "job-routes";
    let mut handle: serde_json::Value = serde_json::from_str(&cluster.handle(job, 3)).unwrap();
    handle["pools"] = serde_json::json!({"b_only": ["dram-b"], "gone": ["dram-z"]});
    handle["routes"] = serde_json::json!({"shuffle": "b_only", "tmp": "gone"});
    cluster.objects(job, 3); // makes the bucket on every server
    let objects = client_of(&handle.to_string());
    let large = payload(2 * MIB + 5, 3);
    let keys: Vec<String> = (0..12).map(|i| format!("shuffle/part-{i}")).collect();
    for key in &keys {
        objects.put("b", key, &large[..900], false, false).unwrap();
    }
    objects
        .put("b", "shuffle/big", &large, false, false)
        .unwrap();
    objects
        .put("b", "tmp/elsewhere", b"default", false, false)
        .unwrap();
    // A view of dram-b alone finds every routed object, every block of the large one too.
    let mut alone = handle.clone();
    alone["servers"] = serde_json::json!([cluster.map(1, 3)["servers"][1]]);
    let only_b = client_of(&alone.to_string());
    for key in &keys {
        assert_eq!(get(&only_b, key, false).unwrap(), &large[..900]);
    }
    assert_eq!(get(&only_b, "shuffle/big", false).unwrap(), large);
    // A route to a pool with no server in the map leaves the default placement.
    let unrouted = View::from_handle_json(&cluster.handle(job, 3)).unwrap();
    let home = |view: &View| {
        view.server_for(b"tmp/elsewhere", 0, false)
            .unwrap()
            .node_id
            .clone()
    };
    assert_eq!(home(&objects.view()), home(&unrouted));
    assert_eq!(get(&objects, "tmp/elsewhere", false).unwrap(), b"default");
}

#[test]
fn a_stale_map_is_adopted_and_earlier_data_still_found() {
    let cluster = Cluster::start();
    let job = "job-stale";
    let objects = cluster.objects(job, 2);
    let large = payload(2 * MIB, 9);
    let keys: Vec<String> = (0..24).map(|i| format!("before-{i}")).collect();
    for key in &keys {
        objects.put("b", key, &large[..1000], false, false).unwrap();
    }
    objects
        .put("b", "big-before", &large, false, false)
        .unwrap();
    // Objects of one data block whose manifest (and so block) has another home in the map of
    // three: a read finds the record, then the block, on the server of the first map.
    let grown = View::from_handle_json(&cluster.handle(job, 3)).unwrap();
    let moved: Vec<String> = (0..200)
        .map(|i| format!("one-before-{i}"))
        .filter(|k| {
            let before = objects.view();
            let home = |view: &View| {
                view.server_for(k.as_bytes(), 0, false)
                    .unwrap()
                    .node_id
                    .clone()
            };
            home(&before) != home(&grown)
        })
        .take(3)
        .collect();
    assert_eq!(moved.len(), 3);
    let one = &large[..BLOCK_SIZE as usize];
    for key in &moved {
        objects.put("b", key, one, false, false).unwrap();
    }
    // The job grows to three servers; this client still has the map of two.
    cluster.set_epoch(job, 2, 3);
    let view = objects.view();
    let body = serde_json::json!({"ctx": {"job": job, "epoch": 2, "token": &view.ctx.token}, "bucket": "b"});
    let third = Connection::new(&cluster.servers[2].1, ConnectionConfig::default()).unwrap();
    block_on(third.action("create_bucket", Bytes::from(body.to_string()))).unwrap();
    let generation = objects.generation();
    objects.put("b", "after", b"new", false, false).unwrap();
    assert_eq!(objects.view().epoch, 2);
    assert!(objects.generation() > generation);
    // Keys and blocks written under the first map are found where they are.
    for key in &keys {
        assert_eq!(get(&objects, key, false).unwrap(), &large[..1000]);
    }
    assert_eq!(get(&objects, "big-before", false).unwrap(), large);
    assert_eq!(get(&objects, "after", false).unwrap(), b"new");
    assert_eq!(get(&objects, &moved[0], false).unwrap(), one);
    let mut range = Buffer::default();
    objects
        .get_range("b", &moved[1], 10, 100, &mut range)
        .unwrap();
    assert_eq!(range.0, &one[10..110]);
    assert_eq!(get(&objects, &moved[2], true).unwrap(), one);
    assert_eq!(
        kind(&get(&objects, &moved[2], false).unwrap_err()),
        "not_found"
    );
    // A waiter finds them too, and only the key nobody wrote is missing.
    let never = || false;
    let stop = Stop {
        asked: &never,
        interval: Duration::from_millis(20),
    };
    let mut awaited: Vec<&str> = keys.iter().map(String::as_str).collect();
    awaited.push("never-written");
    let missing = objects
        .wait_for("b", &awaited, Duration::from_millis(200), stop)
        .unwrap()
        .unwrap();
    assert_eq!(missing, vec![keys.len()]);

    // A renewed handle that still holds the older map (a new token) keeps the newer map.
    let renewed = cluster.handle(job, 2);
    let token: serde_json::Value = serde_json::from_str(&renewed).unwrap();
    objects.set_handle(&renewed).unwrap();
    let view = objects.view();
    assert_eq!(view.epoch, 2);
    assert_eq!(view.servers.len(), 3);
    assert_eq!(view.ctx.token, token["token"].as_str().unwrap());
    assert_eq!(get(&objects, "after", false).unwrap(), b"new");
}

#[test]
fn a_waiter_finds_written_keys_at_once_and_parks_for_the_rest() {
    let cluster = Cluster::start();
    let objects = Arc::new(cluster.objects("job-wait", 3));
    let never = || false;
    let stop = Stop {
        asked: &never,
        interval: Duration::from_millis(20),
    };
    let keys: Vec<String> = (0..12).map(|i| format!("part-{i}")).collect();
    for key in &keys[..6] {
        objects.put("b", key, b"here", false, false).unwrap();
    }
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();

    // A check (timeout 0) reports exactly the missing keys, duplicates once, in order.
    let mut asked = refs.clone();
    asked.push("part-7");
    let missing = objects
        .wait_for("b", &asked, Duration::ZERO, stop)
        .unwrap()
        .unwrap();
    assert_eq!(missing, (6..12).collect::<Vec<_>>());

    // Keys written by another thread while the waiter is parked end the wait early.
    let writer = {
        let objects = Arc::clone(&objects);
        let late = keys[6..].to_vec();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            for key in &late {
                objects.put("b", key, b"late", false, false).unwrap();
            }
        })
    };
    let started = std::time::Instant::now();
    let missing = objects
        .wait_for("b", &refs, Duration::from_secs(20), stop)
        .unwrap()
        .unwrap();
    writer.join().unwrap();
    assert!(missing.is_empty(), "{missing:?}");
    assert!(started.elapsed() < Duration::from_secs(10));

    // A key nobody writes is still missing when the timeout passes.
    let missing = objects
        .wait_for("b", &["part-3", "never"], Duration::from_millis(300), stop)
        .unwrap()
        .unwrap();
    assert_eq!(missing, vec![1]);

    // A caller that gives up ends a parked wait long before its timeout.
    let give_up = std::time::Instant::now() + Duration::from_millis(200);
    let asked = move || std::time::Instant::now() > give_up;
    let started = std::time::Instant::now();
    let stopped = objects
        .wait_for(
            "b",
            &["never"],
            Duration::from_secs(30),
            Stop {
                asked: &asked,
                interval: Duration::from_millis(20),
            },
        )
        .unwrap();
    assert!(stopped.is_none());
    assert!(started.elapsed() < Duration::from_secs(5));

    // A missing bucket is an error, not a key that never comes.
    let error = objects
        .wait_for("no-such-bucket", &["k"], Duration::from_millis(100), stop)
        .unwrap_err();
    assert_eq!(kind(&error.error), "bucket_not_found");
}

#[test]
fn an_object_of_one_data_block_lives_with_its_manifest() {
    let cluster = Cluster::start();
    let objects = Arc::new(cluster.objects("job-one-block", 3));
    let view = objects.view();
    let home = |key: &str, block: u32, persist: bool| {
        view.server_for(key.as_bytes(), block, persist)
            .unwrap()
            .address
            .clone()
    };
    // Keys whose block 1, placed by its own index, would go to another server than block 0.
    let apart = |persist: bool| -> Vec<String> {
        (0..400)
            .map(|i| format!("one-{}-{i}", u8::from(persist)))
            .filter(|k| home(k, 0, persist) != home(k, 1, persist))
            .take(5)
            .collect()
    };
    let keys = apart(false);
    assert_eq!(keys.len(), 5);
    let one = payload(BLOCK_SIZE as usize - 3, 4);
    for key in &keys[..4] {
        objects.put("b", key, &one, false, false).unwrap();
    }
    // Streamed: block 1 waits for a second one, and goes with the manifest when none comes.
    let mut upload = StreamUpload::new(objects.clone(), "b", &keys[4], false).unwrap();
    upload.add(1, one.clone()).unwrap();
    upload.commit(one.len() as u64, false).unwrap();
    for key in &keys {
        let (header, server) = record_of(&objects, key);
        assert_eq!(header.block_count, 1);
        assert_eq!(server, home(key, 0, false));
        assert_eq!(
            holders(&objects, key, header.version, 1),
            vec![server],
            "{key}"
        );
        assert_eq!(get(&objects, key, false).unwrap(), one);
    }

    // A range, a DELETE read (the block goes with the record), a delete (record, then blocks).
    let mut range = Buffer::default();
    let count = objects
        .get_range("b", &keys[0], 1000, 5000, &mut range)
        .unwrap();
    assert_eq!((count, range.0.as_slice()), (5000, &one[1000..6000]));
    let (header, _) = record_of(&objects, &keys[1]);
    assert_eq!(get(&objects, &keys[1], true).unwrap(), one);
    assert_eq!(
        kind(&get(&objects, &keys[1], false).unwrap_err()),
        "not_found"
    );
    assert!(holders(&objects, &keys[1], header.version, 1).is_empty());
    let record = objects
        .fetch_record("b", &keys[2], OpCode::Delete, 0, true)
        .unwrap();
    let header = record.header.unwrap();
    objects.delete_blocks("b", &keys[2], &header);
    assert!(holders(&objects, &keys[2], header.version, 1).is_empty());
    // An overwrite frees the replaced version's block on its home.
    let (replaced, _) = record_of(&objects, &keys[3]);
    objects.put("b", &keys[3], &one[1..], false, true).unwrap();
    assert!(holders(&objects, &keys[3], replaced.version, 1).is_empty());
    assert_eq!(get(&objects, &keys[3], false).unwrap(), &one[1..]);

    // PERSIST objects follow the same rule over the long-running servers.
    for key in &apart(true)[..2] {
        objects.put("b", key, &one, true, false).unwrap();
        let (header, server) = record_of(&objects, key);
        assert!(header.persist());
        assert_eq!(server, home(key, 0, true));
        assert_eq!(holders(&objects, key, header.version, 1), vec![server]);
        assert_eq!(get(&objects, key, true).unwrap(), one);
    }
}

#[test]
fn objects_of_more_data_blocks_stay_striped() {
    let cluster = Cluster::start();
    let objects = Arc::new(cluster.objects("job-striped", 3));
    let view = objects.view();
    let home = |key: &str, block: u32| {
        view.server_for(key.as_bytes(), block, false)
            .unwrap()
            .address
            .clone()
    };
    // A key whose two blocks live on two servers, neither of them block 0's.
    let key = (0..400)
        .map(|i| format!("two-{i}"))
        .find(|k| {
            let (h0, h1, h2) = (home(k, 0), home(k, 1), home(k, 2));
            h1 != h2 && h1 != h0 && h2 != h0
        })
        .expect("a key striped over three servers");
    let two = payload(BLOCK_SIZE as usize + 7, 5);
    objects.put("b", &key, &two, false, false).unwrap();
    let streamed = format!("{key}-streamed");
    let mut upload = StreamUpload::new(objects.clone(), "b", &streamed, false).unwrap();
    let (first, second) = two.split_at(BLOCK_SIZE as usize);
    upload.add(1, first.to_vec()).unwrap();
    upload.add(2, second.to_vec()).unwrap();
    upload.commit(two.len() as u64, false).unwrap();
    for key in [&key, &streamed] {
        let (header, _) = record_of(&objects, key);
        assert_eq!(header.block_count, 2);
        for block in 1..=2 {
            let holders = holders(&objects, key, header.version, block);
            assert_eq!(holders, vec![home(key, block)], "{key} block {block}");
        }
        assert_eq!(get(&objects, key, false).unwrap(), two);
    }

    // A commit whose size disagrees with the blocks added is refused; nothing of it stays.
    let mut upload = StreamUpload::new(objects.clone(), "b", "short", false).unwrap();
    let version = upload.version();
    upload.add(1, first.to_vec()).unwrap();
    upload.add(2, second.to_vec()).unwrap();
    let refused = upload.commit(3 * u64::from(BLOCK_SIZE), false).unwrap_err();
    assert_eq!(kind(&refused.error), "invalid_argument");
    for block in 1..=2 {
        assert!(holders(&objects, "short", version, block).is_empty());
    }
    assert_eq!(
        kind(&get(&objects, "short", false).unwrap_err()),
        "not_found"
    );
}

/// A destination that counts what it was asked for.
#[derive(Default)]
struct Counted {
    bytes: Vec<u8>,
    asked: usize,
}

impl Destination for Counted {
    fn buffer(&mut self, size: usize) -> Result<&mut [u8], ClientError> {
        self.asked += 1;
        self.bytes = vec![0; size];
        Ok(&mut self.bytes)
    }
}

/// A READ ticket of `key` over `objects`' context.
fn read_ticket(objects: &Objects, key: &str, delete: bool, inline_bytes_max: u64) -> Vec<u8> {
    let view = objects.view();
    serde_json::json!({"ctx": &view.ctx, "bucket": "b", "key": key, "delete": delete,
        "inline_bytes_max": inline_bytes_max})
    .to_string()
    .into_bytes()
}

#[test]
fn a_read_brings_the_record_and_its_bytes_in_one_answer() {
    let cluster = Cluster::start();
    let objects = cluster.objects("job-read", 3);
    let small = payload(1000, 1);
    let one = payload(BLOCK_SIZE as usize - 7, 2);
    let striped = payload(2 * BLOCK_SIZE as usize + 5, 3);
    objects.put("b", "small", &small, false, false).unwrap();
    objects.put("b", "one", &one, false, false).unwrap();
    objects.put("b", "striped", &striped, false, false).unwrap();
    let home = |key: &str| record_of(&objects, key).1;

    // Straight from one connection: the value, the one block, a manifest alone, a miss (the
    // connection stays usable after it), all on block 0's home.
    for (key, data, inline_bytes_max, brought) in [
        ("small", &small, 0, true),
        ("one", &one, u64::from(BLOCK_SIZE), true),
        ("one", &one, one.len() as u64 - 1, false),
        ("striped", &striped, u64::MAX, false),
    ] {
        let connection = objects.connection(&home(key)).unwrap();
        let mut dest = Counted::default();
        let read = connection
            .read_object_blocking(
                &read_ticket(&objects, key, false, inline_bytes_max),
                &mut dest,
            )
            .unwrap()
            .expect("the server reads so");
        assert_eq!(read.reply.status, 0, "{key}");
        assert!(read.error.is_none());
        assert_eq!(read.reply.header.unwrap().size, data.len() as u64);
        if brought {
            assert_eq!((read.received, dest.asked), (data.len() as u64, 1));
            assert_eq!(&dest.bytes, data);
        } else {
            assert_eq!((read.received, dest.asked), (0, 0), "{key}");
        }
        let mut dest = Counted::default();
        let miss = connection
            .read_object_blocking(&read_ticket(&objects, "nope", false, 0), &mut dest)
            .unwrap()
            .unwrap();
        assert_eq!(miss.reply.status, tonic::Code::NotFound as u8);
        assert!(String::from_utf8_lossy(&miss.reply.body).starts_with("not_found: "));
    }

    // Through the object layer: one allocation each, DELETE reads leave nothing.
    for (key, data) in [("small", &small), ("one", &one), ("striped", &striped)] {
        let mut dest = Counted::default();
        assert_eq!(objects.get("b", key, true, &mut dest).unwrap(), data.len());
        assert_eq!((&dest.bytes, dest.asked), (data, 1));
        assert_eq!(kind(&get(&objects, key, false).unwrap_err()), "not_found");
    }
    assert_eq!(
        kind(&get(&objects, "nope", false).unwrap_err()),
        "not_found"
    );
}

#[test]
fn a_one_block_object_whose_block_lives_elsewhere_is_still_read_whole() {
    // As written by a client that placed the block as `(key, 1)`, then the map changed: the
    // READ under the old epoch is told the new map, the next brings the manifest alone, and the
    // reader finds the block where the fallbacks of a changed map look.
    let cluster = Cluster::start();
    let objects = cluster.objects("job-read-apart", 3);
    let view = objects.view();
    let home = |key: &str, block: u32| {
        view.server_for(key.as_bytes(), block, false)
            .unwrap()
            .address
            .clone()
    };
    let key = (0..400)
        .map(|i| format!("apart-{i}"))
        .find(|k| home(k, 0) != home(k, 1))
        .unwrap();
    let data = payload(BLOCK_SIZE as usize / 2, 9);
    let version = 77;
    let descriptor = serde_json::json!({"ctx": &view.ctx, "bucket": "b", "key": &key,
        "version": version, "block_size": BLOCK_SIZE, "persist": false});
    let elsewhere = objects.connection(&home(&key, 1)).unwrap();
    elsewhere
        .put_blocks_blocking(
            Bytes::from(descriptor.to_string()),
            &[BlockSlice {
                index: 1,
                data: &data,
            }],
        )
        .unwrap();
    let manifest = ObjectHeader {
        version,
        size: data.len() as u64,
        block_count: 1,
        block_size: BLOCK_SIZE,
        flags: 0,
    };
    let put = ExchangeRequest {
        op: OpCode::Put,
        flags: 0,
        bucket: "b".into(),
        key: key.clone(),
        header: manifest,
        value: Bytes::new(),
    };
    let at_home = objects.connection(&home(&key, 0)).unwrap();
    let replies = at_home
        .exchange_blocking(&view.exchange_command, view.epoch, &[put], 1)
        .unwrap();
    assert_eq!(replies[0].status, 0);
    cluster.set_epoch("job-read-apart", 2, 3);
    let mut dest = Counted::default();
    assert_eq!(objects.get("b", &key, true, &mut dest).unwrap(), data.len());
    assert_eq!(objects.view().epoch, 2);
    assert_eq!((&dest.bytes, dest.asked), (&data, 1));
    assert!(
        holders(&objects, &key, version, 1).is_empty(),
        "the DELETE read freed it"
    );
}

/// A channel op on segment `segment` of `key` with its arguments in the header's fields
/// (`a`..`d`: version, size, block count, block size), as `pocketflow/channels.py` sends it.
fn segment_op(
    op: OpCode,
    key: &str,
    segment: u32,
    args: [u64; 4],
    value: Bytes,
) -> ExchangeRequest {
    ExchangeRequest {
        op,
        flags: 0,
        bucket: "b".into(),
        key: key.into(),
        header: ObjectHeader {
            version: args[0],
            size: args[1],
            block_count: segment,
            block_size: args[3] as u32,
            flags: 0,
        },
        value,
    }
}

#[test]
fn a_placed_run_adopts_a_newer_map_and_makes_the_bucket_on_an_added_server() {
    // The job grows from two servers to three while this client holds the map of two; the
    // segment is one the grown map places on the added server, which never saw the bucket. One
    // run of appends that fill two request frames is refused as stale, adopts the map, is
    // refused with bucket_not_found there, makes the bucket and runs again: every append lands
    // once, on the added server.
    let cluster = Cluster::start();
    let job = "job-placed";
    let objects = cluster.objects(job, 2);
    let grown = View::from_handle_json(&cluster.handle(job, 3)).unwrap();
    let segment = 3;
    let added = &cluster.servers[2].1;
    let key = (0..400)
        .map(|i| format!("channel-{i}"))
        .find(|k| {
            &grown
                .server_for(k.as_bytes(), segment, false)
                .unwrap()
                .address
                == added
        })
        .unwrap();
    cluster.set_epoch(job, 2, 3);
    let record = Bytes::from(payload(60 * 1024, 5));
    let appends: Vec<ExchangeRequest> = (0..150)
        .map(|_| {
            segment_op(
                OpCode::Append,
                &key,
                segment,
                [0, 32 * MIB as u64, 0, 0],
                record.clone(),
            )
        })
        .collect();
    assert!(appends.len() * record.len() > FRAME_MAX_BYTES);
    let generation = objects.generation();
    let replies = objects.run_placed(&appends, segment).unwrap();
    assert_eq!(objects.view().epoch, 2);
    assert!(objects.generation() > generation);
    assert_eq!(replies.len(), appends.len());
    let mut offsets: Vec<u64> = replies
        .iter()
        .map(|(server, reply)| {
            assert_eq!((server.as_str(), reply.status), (added.as_str(), 0));
            reply.header.unwrap().size
        })
        .collect();
    offsets.sort_unstable();
    let expected: Vec<u64> = (0..150).map(|i| i * record.len() as u64).collect();
    assert_eq!(offsets, expected, "each append landed once, back to back");

    // One op is the same run: a client still on the map of two adopts it and finds the segment
    // where the grown map places it, holding exactly those bytes.
    let old = client_of(&cluster.handle(job, 2));
    let state = segment_op(OpCode::ReadAppend, &key, segment, [0; 4], Bytes::new());
    let (server, reply) = old.call_placed(state, segment).unwrap();
    assert_eq!((&server, reply.status, old.view().epoch), (added, 0, 2));
    assert_eq!(reply.header.unwrap().size, 150 * record.len() as u64);
}

#[test]
fn a_placed_run_is_bounded_and_on_one_key() {
    let cluster = Cluster::start();
    let objects = cluster.objects("job-placed-bounds", 3);
    assert!(objects.run_placed(&[], 0).unwrap().is_empty());
    let state = |key: &str| segment_op(OpCode::ReadAppend, key, 0, [0; 4], Bytes::new());
    let too_many = vec![state("log"); PLACED_OPS_MAX + 1];
    let failure = objects.run_placed(&too_many, 0).unwrap_err();
    assert_eq!(kind(&failure.error), "invalid_argument");
    assert!(
        failure.error.to_string().contains("at most 1024"),
        "{}",
        failure.error
    );
    let mixed = [state("log"), state("other")];
    let failure = objects.run_placed(&mixed, 0).unwrap_err();
    assert_eq!(kind(&failure.error), "invalid_argument");
    // Exactly the bound runs, on one session; a segment nobody wrote has length 0.
    let replies = objects.run_placed(&too_many[1..], 0).unwrap();
    assert_eq!(replies.len(), PLACED_OPS_MAX);
    assert!(replies
        .iter()
        .all(|(_, reply)| reply.status == 0 && reply.header.unwrap().size == 0));
}
