//! Unit tests of the store, on both tiers.

use std::time::Instant;

use pocketflow_protocol::limits::{
    BLOCK_SIZE_MAX_BYTES, ENUMERATE_LIMIT_MAX, OVERFLOW_VALUE_MAX_BYTES,
};
use pocketflow_protocol::{
    ObjectHeader, HEADER_FLAG_FENCE, HEADER_FLAG_OVERFLOW, HEADER_FLAG_PERSIST,
};

use crate::events::EventOp;

use super::*;
use crate::error::CapacityLimit;
use crate::refusals::RefusalCounts;

const JOB: &str = "job-a";

/// A store of `tier`; the temporary directory of an NVMe file lives as long as the store.
fn open(tier: Tier, capacity_bytes: u64, long_running: bool) -> (Store, Option<tempfile::TempDir>) {
    let dir = (tier == Tier::Nvme)
        .then(|| tempfile::tempdir_in("/tmp").expect("temp dir on an O_DIRECT file system"));
    let nvme_path = dir.as_ref().map(|d| d.path().join("blocks"));
    let store = Store::open(StoreConfig {
        tier,
        capacity_bytes,
        nvme_path,
        long_running,
        persist_ttl: None,
        shared_dram: false,
    })
    .unwrap();
    (store, dir)
}

/// A long-running store whose PERSIST entries live `ttl`.
fn open_with_ttl(tier: Tier, ttl: Duration) -> (Store, Option<tempfile::TempDir>) {
    let (store, dir) = open(tier, 1 << 20, true);
    let engine = Arc::clone(&store.shared.engine);
    drop(store);
    (Store::build(engine, true, Some(ttl)), dir)
}

fn small(version: u64, value: &[u8]) -> ObjectHeader {
    ObjectHeader {
        version,
        size: value.len() as u64,
        ..Default::default()
    }
}

fn manifest(version: u64, size: u64, block_size: u32) -> ObjectHeader {
    let block_count = size.div_ceil(u64::from(block_size)) as u32;
    ObjectHeader {
        version,
        size,
        block_count,
        block_size,
        flags: 0,
    }
}

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect::<Vec<_>>()
        .into()
}

async fn put(
    store: &Store,
    bucket: &str,
    key: &str,
    value: &[u8],
) -> Result<Option<ObjectHeader>, StoreError> {
    store
        .put_record(
            JOB,
            bucket,
            key,
            small(1, value),
            Bytes::copy_from_slice(value),
            false,
        )
        .await
}

/// A small PERSIST record of version 1 in bucket "b" (replacing one when `overwrite`).
async fn put_persist(
    store: &Store,
    key: &str,
    value: &'static [u8],
    overwrite: bool,
) -> Result<Option<ObjectHeader>, StoreError> {
    let header = ObjectHeader {
        flags: HEADER_FLAG_PERSIST,
        ..small(1, value)
    };
    store
        .put_record(JOB, "b", key, header, Bytes::from_static(value), overwrite)
        .await
}

/// The PERSIST data block 1 of "big" (version 9) in bucket "b": `abc`.
async fn put_persist_block(store: &Store) {
    let mut write = store
        .begin_block(JOB, "b", "big", 9, 1, 3, true)
        .await
        .unwrap();
    write.append(Bytes::from_static(b"abc")).await.unwrap();
    write.commit().await.unwrap();
}

async fn put_block(
    store: &Store,
    key: &str,
    version: u64,
    index: u32,
    data: &Bytes,
) -> Result<(), StoreError> {
    let mut write = store
        .begin_block(JOB, "b", key, version, index, data.len() as u64, false)
        .await?;
    for piece in data.chunks(7000) {
        write.append(data.slice_ref(piece)).await?;
    }
    write.commit().await
}

async fn small_objects_round_trip(tier: Tier) {
    let (store, _dir) = open(tier, 1 << 20, false);
    store.create_bucket(JOB, "b").unwrap();
    assert!(matches!(
        store.create_bucket(JOB, "b"),
        Err(StoreError::BucketExists { .. })
    ));
    assert_eq!(put(&store, "b", "k1", b"hello").await.unwrap(), None);
    put(&store, "b", "empty", b"").await.unwrap();
    let (header, value) = store.get_record(JOB, "b", "k1", false).await.unwrap();
    assert_eq!((header.size, &value[..]), (5, &b"hello"[..]));
    assert_eq!(
        store
            .get_record(JOB, "b", "empty", false)
            .await
            .unwrap()
            .1
            .len(),
        0
    );
    assert_eq!(store.lookup(JOB, "b", "k1").unwrap(), header);
    drop(value);
    assert_eq!(store.usage().objects, 2);
    let allocation = if tier == Tier::Dram { 64 } else { 4096 };
    let expected_used = allocation + 2 * INDEX_ENTRY_OVERHEAD_BYTES + 2 + 5;
    assert_eq!(store.used_bytes(), expected_used);
    assert_eq!(
        store.usage().per_job[JOB],
        JobUsage {
            used_bytes: expected_used,
            objects: 2,
            channel_entries: 0,
            reserved_bytes: 0,
            refusals: RefusalCounts::default(),
        }
    );
    // A delete of another version leaves the record; of its own version removes it.
    assert!(matches!(
        store.delete_record_version(JOB, "b", "k1", Some(header.version + 1)),
        Err(StoreError::NotFound { .. })
    ));
    assert_eq!(
        store
            .delete_record_version(JOB, "b", "k1", Some(header.version))
            .unwrap(),
        header
    );
    put(&store, "b", "k1", b"hello").await.unwrap();
    assert_eq!(store.delete_record(JOB, "b", "k1").unwrap(), header);
    assert!(matches!(
        store.get_record(JOB, "b", "k1", false).await,
        Err(StoreError::NotFound { .. })
    ));
    assert!(matches!(
        store.delete_record(JOB, "b", "k1"),
        Err(StoreError::NotFound { .. })
    ));
    assert!(matches!(
        put(&store, "nope", "k", b"x").await,
        Err(StoreError::BucketNotFound { .. })
    ));
    assert_eq!(
        store.delete_bucket(JOB, "b").unwrap(),
        INDEX_ENTRY_OVERHEAD_BYTES + 5
    );
    assert!(matches!(
        store.delete_bucket(JOB, "b"),
        Err(StoreError::BucketNotFound { .. })
    ));
    assert_eq!(store.used_bytes(), 0);
    assert!(store.is_empty());
    assert!(store.usage().per_job.is_empty());
}

async fn write_once_and_overwrite(tier: Tier) {
    let (store, _dir) = open(tier, 1 << 20, false);
    store.create_bucket(JOB, "b").unwrap();
    put(&store, "b", "k", b"first").await.unwrap();
    let used = store.used_bytes();
    let second = store
        .put_record(
            JOB,
            "b",
            "k",
            small(2, b"second"),
            Bytes::from_static(b"second"),
            false,
        )
        .await;
    assert!(matches!(second, Err(StoreError::AlreadyExists { .. })));
    assert_eq!(
        store.used_bytes(),
        used,
        "a refused put leaves nothing behind"
    );
    let replaced = store
        .put_record(
            JOB,
            "b",
            "k",
            small(2, b"second"),
            Bytes::from_static(b"second"),
            true,
        )
        .await
        .unwrap();
    assert_eq!(replaced.map(|h| h.version), Some(1));
    let (header, value) = store.get_record(JOB, "b", "k", false).await.unwrap();
    assert_eq!((header.version, &value[..]), (2, &b"second"[..]));
    assert_eq!(store.usage().objects, 1);
}

async fn invalid_puts_are_refused(tier: Tier) {
    let (store, _dir) = open(tier, 1 << 20, false);
    store.create_bucket(JOB, "b").unwrap();
    let refused = put_persist(&store, "k", b"x", false).await;
    assert!(matches!(refused, Err(StoreError::PersistRefused)));
    assert!(matches!(
        store.begin_block(JOB, "b", "k", 1, 1, 10, true).await,
        Err(StoreError::PersistRefused)
    ));
    let mismatch = store
        .put_record(
            JOB,
            "b",
            "k",
            small(1, b"xy"),
            Bytes::from_static(b"x"),
            false,
        )
        .await;
    assert!(matches!(
        mismatch,
        Err(StoreError::ValueLengthMismatch {
            expected: 2,
            actual: 1
        })
    ));
    let manifest_with_value = store
        .put_record(
            JOB,
            "b",
            "k",
            manifest(1, 100, 64),
            Bytes::from_static(b"x"),
            false,
        )
        .await;
    assert!(matches!(
        manifest_with_value,
        Err(StoreError::ValueLengthMismatch {
            expected: 0,
            actual: 1
        })
    ));
    let zero_version = store
        .put_record(
            JOB,
            "b",
            "k",
            small(0, b"x"),
            Bytes::from_static(b"x"),
            false,
        )
        .await;
    assert_eq!(zero_version.unwrap_err().kind(), "invalid_argument");
    let long_key = "k".repeat(KEY_MAX_BYTES + 1);
    assert!(matches!(
        put(&store, "b", &long_key, b"x").await,
        Err(StoreError::InvalidName { what: "key", .. })
    ));
    assert!(matches!(
        store.begin_block(JOB, "b", "k", 1, 0, 10, false).await,
        Err(StoreError::InvalidBlockAddress { .. })
    ));
    assert!(matches!(
        store.begin_block(JOB, "b", "k", 1, 1, 0, false).await,
        Err(StoreError::EmptyBlock)
    ));
    let too_large = store
        .begin_block(
            JOB,
            "b",
            "k",
            1,
            1,
            u64::from(BLOCK_SIZE_MAX_BYTES) + 1,
            false,
        )
        .await;
    assert!(matches!(too_large, Err(StoreError::BlockTooLarge { .. })));
    assert_eq!(store.used_bytes(), 0);
    assert!(store.is_empty());
}

async fn persist_on_long_running(tier: Tier) {
    let (store, _dir) = open(tier, 1 << 20, true);
    store.create_bucket(JOB, "b").unwrap();
    put_persist(&store, "kept", b"keep", false).await.unwrap();
    put(&store, "b", "dropped", b"drop").await.unwrap();
    put_persist_block(&store).await;
    store.create_bucket(JOB, "scratch").unwrap();
    let (deleted, freed) = store.delete_job(JOB);
    assert_eq!(
        (deleted, freed),
        (
            1,
            INDEX_ENTRY_OVERHEAD_BYTES + 7 + if tier == Tier::Dram { 64 } else { 4096 }
        )
    );
    assert_eq!(
        store.get_record(JOB, "b", "kept", false).await.unwrap().1,
        Bytes::from_static(b"keep")
    );
    assert_eq!(
        store.read_block(JOB, "b", "big", 9, 1, 0, 3).await.unwrap(),
        Bytes::from_static(b"abc")
    );
    assert!(matches!(
        store.enumerate(JOB, "scratch", "", None, 10),
        Err(StoreError::BucketNotFound { .. })
    ));
    assert_eq!(store.usage().objects, 1);
    let used = store.used_bytes();
    assert_eq!(store.delete_bucket(JOB, "b").unwrap(), used);
    assert_eq!(store.used_bytes(), 0);
    assert!(store.is_empty());

    // The operator's delete of an ended job's data takes the PERSIST data too.
    store.create_bucket(JOB, "b").unwrap();
    put_persist(&store, "kept", b"keep", false).await.unwrap();
    put_persist_block(&store).await;
    store.delete_job(JOB);
    let used = store.used_bytes();
    assert!(used > 0);
    // One record ("kept"); the bytes of its data block count too.
    assert_eq!(store.delete_job_with_persist(JOB), (1, used));
    assert_eq!(store.used_bytes(), 0);
    assert!(store.is_empty());
    assert!(store.usage().per_job.is_empty());
    assert_eq!(store.delete_job_with_persist(JOB), (0, 0));
}

async fn data_blocks(tier: Tier) {
    let (store, _dir) = open(tier, 4 << 20, false);
    store.create_bucket(JOB, "b").unwrap();
    let data = pattern(100_000, 4);
    put_block(&store, "obj", 5, 1, &data).await.unwrap();
    put_block(&store, "obj", 5, 2, &data.slice(..10))
        .await
        .unwrap();
    store
        .put_record(
            JOB,
            "b",
            "obj",
            manifest(5, 100_010, 100_000),
            Bytes::new(),
            false,
        )
        .await
        .unwrap();
    assert_eq!(
        store
            .get_record(JOB, "b", "obj", false)
            .await
            .unwrap()
            .1
            .len(),
        0
    );
    assert_eq!(
        store
            .read_block(JOB, "b", "obj", 5, 1, 0, 100_000)
            .await
            .unwrap(),
        data
    );
    assert_eq!(
        store
            .read_block(JOB, "b", "obj", 5, 1, 4095, 3)
            .await
            .unwrap(),
        data.slice(4095..4098)
    );
    assert_eq!(
        store
            .read_block(JOB, "b", "obj", 5, 2, 10, 0)
            .await
            .unwrap()
            .len(),
        0
    );
    assert_eq!(
        store.block_len(JOB, "b", "obj", 5, 1).unwrap(),
        Some(100_000)
    );
    assert_eq!(store.block_len(JOB, "b", "obj", 5, 2).unwrap(), Some(10));
    assert_eq!(store.block_len(JOB, "b", "obj", 5, 3).unwrap(), None);
    assert_eq!(store.block_len(JOB, "b", "obj", 6, 1).unwrap(), None);
    assert!(matches!(
        store.block_len(JOB, "nope", "obj", 5, 1),
        Err(StoreError::BucketNotFound { .. })
    ));
    let past_end = store.read_block(JOB, "b", "obj", 5, 2, 5, 6).await;
    assert!(matches!(
        past_end,
        Err(StoreError::InvalidRange {
            offset: 5,
            len: 6,
            block_len: 10
        })
    ));
    assert!(matches!(
        store.read_block(JOB, "b", "obj", 6, 1, 0, 1).await,
        Err(StoreError::BlockNotFound { .. })
    ));
    assert!(matches!(
        put_block(&store, "obj", 5, 1, &data).await,
        Err(StoreError::BlockExists { .. })
    ));
    // Short and long writes are refused, and uncommitted writes free their reservation.
    let before = store.used_bytes();
    let mut short = store
        .begin_block(JOB, "b", "obj", 7, 1, 100, false)
        .await
        .unwrap();
    short.append(pattern(50, 0)).await.unwrap();
    assert!(matches!(
        short.append(pattern(51, 0)).await,
        Err(StoreError::LengthMismatch {
            expected: 100,
            actual: 101
        })
    ));
    assert!(matches!(
        short.commit().await,
        Err(StoreError::LengthMismatch {
            expected: 100,
            actual: 50
        })
    ));
    assert_eq!(store.used_bytes(), before);
    // Blocks read before deletion stay valid and hold their space until dropped.
    let held = store
        .read_block(JOB, "b", "obj", 5, 1, 0, 100_000)
        .await
        .unwrap();
    let freed = store.delete_blocks(JOB, "b", "obj", 5, &[1, 2, 3]).unwrap();
    let block_cost =
        |len| store.shared.engine.allocation_bytes(len) + INDEX_ENTRY_OVERHEAD_BYTES + 3;
    assert_eq!(freed, block_cost(100_000) + block_cost(10));
    assert_eq!(
        store.used_bytes(),
        before - block_cost(10),
        "the held block is still charged"
    );
    assert_eq!(held, data);
    drop(held);
    assert_eq!(store.used_bytes(), before - freed);
    assert_eq!(store.delete_record(JOB, "b", "obj").unwrap().version, 5);
    assert_eq!(store.used_bytes(), 0);
    assert!(store.is_empty());
}

async fn exhaustion_leaves_nothing(tier: Tier) {
    let capacity = 256 * 1024;
    let (store, _dir) = open(tier, capacity, false);
    store.create_bucket(JOB, "b").unwrap();
    let data = pattern(60_000, 1);
    let mut stored = 0;
    loop {
        let key = format!("k{stored}");
        match store
            .put_record(JOB, "b", &key, small(1, &data), data.clone(), false)
            .await
        {
            Ok(_) => stored += 1,
            Err(StoreError::CapacityExhausted {
                requested,
                available,
                ..
            }) => {
                assert!(requested > available);
                break;
            }
            Err(other) => panic!("unexpected {other}"),
        }
    }
    assert_eq!(stored, 4);
    assert_eq!(store.usage().objects, 4);
    let used = store.used_bytes();
    assert!(matches!(
        store
            .begin_block(JOB, "b", "big", 1, 1, 100_000, false)
            .await,
        Err(StoreError::CapacityExhausted { .. })
    ));
    assert_eq!(store.used_bytes(), used);
    // Freed space is reused.
    let (_, value) = store.get_record(JOB, "b", "k0", true).await.unwrap();
    assert_eq!(
        store.used_bytes(),
        used,
        "a delete-on-read frees when the bytes are dropped"
    );
    drop(value);
    assert!(store.used_bytes() < used);
    put(&store, "b", "again", &data).await.unwrap();
    assert_eq!(store.delete_prefix(JOB, "b", "").unwrap().0, 4);
    assert_eq!(store.used_bytes(), 0);
}

async fn manifests_still_fit_a_tier_full_of_data(tier: Tier) {
    // Data stops at the records' reserve (1/64 of the capacity); a manifest, and an overflowed
    // manifest with its list of skipped servers, go on into it: a full home still takes the
    // records of objects whose bytes a client wrote on other servers.
    let capacity = 4 << 20;
    let (store, _dir) = open(tier, capacity, false);
    store.create_bucket(JOB, "b").unwrap();
    let data = pattern(60_000, 3);
    let mut stored = 0;
    let refused = loop {
        match put(&store, "b", &format!("k{stored}"), &data).await {
            Ok(_) => stored += 1,
            Err(e) => break e,
        }
        assert!(stored < 200, "the tier never filled");
    };
    match refused {
        StoreError::CapacityExhausted {
            requested,
            available,
            limit:
                CapacityLimit::Data {
                    capacity_bytes,
                    reserve_bytes,
                },
        } => {
            assert!(requested > available);
            assert_eq!((capacity_bytes, reserve_bytes), (capacity, capacity / 64));
            assert!(store.used_bytes() + available <= capacity - reserve_bytes);
        }
        other => panic!("expected the data limit, got {other}"),
    }
    assert!(matches!(
        store
            .begin_block(JOB, "b", "blocks", 7, 1, 100_000, false)
            .await,
        Err(StoreError::CapacityExhausted { .. })
    ));
    store
        .put_record(
            JOB,
            "b",
            "manifest",
            manifest(2, 5 << 20, 1 << 20),
            Bytes::new(),
            false,
        )
        .await
        .unwrap();
    let overflowed = ObjectHeader {
        flags: HEADER_FLAG_OVERFLOW,
        ..manifest(3, 5 << 20, 1 << 20)
    };
    let skipped = Bytes::from_static(br#"["dram-0","dram-1"]"#);
    store
        .put_record(JOB, "b", "overflowed", overflowed, skipped.clone(), false)
        .await
        .unwrap();
    // Its value comes back with the record, and a DELETE read claims it whole.
    let (header, value) = store
        .get_record(JOB, "b", "overflowed", true)
        .await
        .unwrap();
    assert!(header.overflowed());
    assert_eq!(value, skipped);
    // The reserve is bounded too: records alone fill it, then they are refused naming it.
    let mut records = 0;
    let refused = loop {
        let key = format!("m{records}");
        match store
            .put_record(
                JOB,
                "b",
                &key,
                manifest(4, 1 << 20, 1 << 20),
                Bytes::new(),
                false,
            )
            .await
        {
            Ok(_) => records += 1,
            Err(e) => break e,
        }
        assert!(records < 100_000, "the reserve never filled");
    };
    assert!(records > 100, "{records} records");
    assert!(matches!(
        refused,
        StoreError::CapacityExhausted {
            limit: CapacityLimit::Records { .. },
            ..
        }
    ));
    // Each refusal was counted once under its limit, server-wide and to the job.
    let usage = store.usage();
    let counted = RefusalCounts {
        data: 2,
        records: 1,
        ..RefusalCounts::default()
    };
    assert_eq!(usage.refusals, counted);
    assert_eq!(usage.per_job[JOB].refusals, counted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fragmented_free_space_is_counted_as_extent_refusals() {
    // Fifteen 64 KiB objects fill a 1 MiB DRAM tier's room for data; deleting every other one
    // leaves 512 KiB free in 64 KiB holes, so a 128 KiB data block fits the budget but no
    // extent.
    let (store, _dir) = open(Tier::Dram, 1 << 20, false);
    store.create_bucket(JOB, "b").unwrap();
    store.create_bucket("job-b", "b").unwrap();
    let data = pattern(64 << 10, 5);
    for i in 0..15 {
        put(&store, "b", &format!("k{i}"), &data).await.unwrap();
    }
    for i in (1..15).step_by(2) {
        store.delete_record(JOB, "b", &format!("k{i}")).unwrap();
    }
    let used = store.used_bytes();
    let large = pattern(128 << 10, 6);
    match put_block(&store, "large", 1, 1, &large).await {
        Err(StoreError::CapacityExhausted {
            available,
            limit: CapacityLimit::Extent { largest_free_bytes },
            ..
        }) => {
            assert_eq!(largest_free_bytes, 64 << 10);
            assert_eq!(available, 8 * (64 << 10));
        }
        other => panic!("expected no free extent, got {other:?}"),
    }
    // Each try is refused again; nothing of them is left charged.
    assert!(matches!(
        put_block(&store, "large", 1, 2, &large).await,
        Err(StoreError::CapacityExhausted {
            limit: CapacityLimit::Extent { .. },
            ..
        })
    ));
    assert_eq!(store.used_bytes(), used);
    let usage = store.usage();
    let counted = RefusalCounts {
        extent: 2,
        ..RefusalCounts::default()
    };
    assert_eq!(usage.refusals, counted);
    assert_eq!(usage.per_job[JOB].refusals, counted);
    assert_eq!(usage.per_job["job-b"].refusals, RefusalCounts::default());
    // What fits a hole is taken, and counts nothing.
    put(&store, "b", "fits", &data).await.unwrap();
    assert_eq!(store.usage().refusals, counted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_lists_a_job_with_a_share_and_no_bucket() {
    let (store, _dir) = open(Tier::Dram, 1 << 20, false);
    store.set_reservation("job-share", 1, 256 << 10);
    store.create_bucket(JOB, "b").unwrap();
    put(&store, "b", "k", b"v").await.unwrap();
    let usage = store.usage();
    assert_eq!(
        usage.per_job.keys().collect::<Vec<_>>(),
        ["job-a", "job-share"]
    );
    assert_eq!(
        usage.per_job["job-share"],
        JobUsage {
            reserved_bytes: 256 << 10,
            ..JobUsage::default()
        }
    );
    // Its end takes it off the list.
    store.end_reservation("job-share");
    assert_eq!(store.usage().per_job.keys().collect::<Vec<_>>(), ["job-a"]);
}

async fn overflowed_manifests_carry_a_bounded_value(tier: Tier) {
    let (store, _dir) = open(tier, 1 << 20, false);
    store.create_bucket(JOB, "b").unwrap();
    let overflowed = ObjectHeader {
        flags: HEADER_FLAG_OVERFLOW,
        ..manifest(1, 10, 16)
    };
    let too_long = Bytes::from(vec![b'x'; OVERFLOW_VALUE_MAX_BYTES as usize + 1]);
    for (header, value) in [
        (overflowed, Bytes::new()),
        (overflowed, too_long),
        (manifest(1, 10, 16), Bytes::from_static(b"[]")),
    ] {
        assert!(matches!(
            store.put_record(JOB, "b", "k", header, value, false).await,
            Err(StoreError::ValueLengthMismatch { .. })
        ));
    }
    // A small object never carries the flag.
    let flagged_small = ObjectHeader {
        flags: HEADER_FLAG_OVERFLOW,
        ..small(1, b"abc")
    };
    assert!(matches!(
        store
            .put_record(
                JOB,
                "b",
                "k",
                flagged_small,
                Bytes::from_static(b"abc"),
                false
            )
            .await,
        Err(StoreError::BadHeader(_))
    ));
    assert!(store.is_empty());
}

async fn concurrent_delete_on_read_has_one_winner(tier: Tier) {
    let (store, _dir) = open(tier, 4 << 20, false);
    store.create_bucket(JOB, "b").unwrap();
    for round in 0..20 {
        let key = format!("k{round}");
        let value = pattern(1000 + round, round as u8);
        put(&store, "b", &key, &value).await.unwrap();
        let readers: Vec<_> = (0..8)
            .map(|_| {
                let store = store.clone();
                let key = key.clone();
                tokio::spawn(async move { store.get_record(JOB, "b", &key, true).await })
            })
            .collect();
        let mut winners = 0;
        for reader in readers {
            match reader.await.unwrap() {
                Ok((_, bytes)) => {
                    assert_eq!(bytes, value);
                    winners += 1;
                }
                Err(StoreError::NotFound { .. }) => {}
                Err(other) => panic!("unexpected {other}"),
            }
        }
        assert_eq!(winners, 1, "round {round}");
    }
    assert_eq!(store.used_bytes(), 0);
    assert!(store.is_empty());
}

async fn jobs_are_isolated(tier: Tier) {
    let (store, _dir) = open(tier, 1 << 20, false);
    store.create_bucket(JOB, "b").unwrap();
    store.create_bucket("job-b", "b").unwrap();
    put(&store, "b", "k", b"mine").await.unwrap();
    assert!(matches!(
        store.get_record("job-b", "b", "k", false).await,
        Err(StoreError::NotFound { .. })
    ));
    assert!(matches!(
        store.lookup("job-c", "b", "k"),
        Err(StoreError::BucketNotFound { .. })
    ));
    assert_eq!(
        store.enumerate("job-b", "b", "", None, 10).unwrap(),
        (vec![], false)
    );
    assert_eq!(store.delete_prefix("job-b", "b", "").unwrap(), (0, 0));
    assert_eq!(store.delete_job("job-b"), (0, 0));
    assert_eq!(
        store.get_record(JOB, "b", "k", false).await.unwrap().1,
        Bytes::from_static(b"mine")
    );
    let usage = store.usage();
    assert_eq!(usage.per_job.keys().collect::<Vec<_>>(), [JOB]);
    assert_eq!(usage.per_job[JOB].used_bytes, usage.used_bytes);
}

async fn enumerate_pages_and_prefixes(tier: Tier) {
    let (store, _dir) = open(tier, 4 << 20, false);
    store.create_bucket(JOB, "b").unwrap();
    for i in 0..25 {
        put(&store, "b", &format!("map/{i:02}"), &vec![1; i])
            .await
            .unwrap();
    }
    put(&store, "b", "mapper", b"x").await.unwrap();
    put(&store, "b", "reduce/0", b"y").await.unwrap();
    put_block(&store, "map/99", 3, 1, &pattern(5000, 0))
        .await
        .unwrap();
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let (page, truncated) = store
            .enumerate(JOB, "b", "map/", after.as_deref(), 10)
            .unwrap();
        assert!(page.len() <= 10);
        seen.extend(page.iter().cloned());
        after = page.last().map(|(k, _)| k.clone());
        if !truncated {
            break;
        }
    }
    let expected: Vec<(String, u64)> = (0..25).map(|i| (format!("map/{i:02}"), i as u64)).collect();
    assert_eq!(seen, expected);
    let (page, truncated) = store.enumerate(JOB, "b", "map/", Some("a"), 2).unwrap();
    assert_eq!((page[0].0.as_str(), truncated), ("map/00", true));
    assert_eq!(
        store.enumerate(JOB, "b", "map/", Some("zzz"), 2).unwrap(),
        (vec![], false)
    );
    assert!(matches!(
        store.enumerate(JOB, "b", "", None, 0),
        Err(StoreError::InvalidLimit { .. })
    ));
    assert!(matches!(
        store.enumerate(JOB, "b", "", None, ENUMERATE_LIMIT_MAX + 1),
        Err(StoreError::InvalidLimit { .. })
    ));
    let used = store.used_bytes();
    let (deleted, freed) = store.delete_prefix(JOB, "b", "map/").unwrap();
    assert_eq!(deleted, 25);
    assert_eq!(store.used_bytes(), used - freed);
    assert_eq!(
        store
            .read_block(JOB, "b", "map/99", 3, 1, 0, 1)
            .await
            .unwrap_err()
            .kind(),
        "not_found"
    );
    let rest: Vec<String> = store
        .enumerate(JOB, "b", "", None, 100)
        .unwrap()
        .0
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(rest, ["mapper", "reduce/0"]);
    assert_eq!(store.delete_job(JOB).0, 2);
    assert_eq!(store.used_bytes(), 0);
    assert!(store.is_empty());
    assert!(store.usage().per_job.is_empty());
}

async fn deleting_a_bucket_under_a_write_leaks_nothing(tier: Tier) {
    let (store, _dir) = open(tier, 1 << 20, false);
    store.create_bucket(JOB, "b").unwrap();
    let mut write = store
        .begin_block(JOB, "b", "k", 1, 1, 10_000, false)
        .await
        .unwrap();
    write.append(pattern(10_000, 1)).await.unwrap();
    assert!(store.used_bytes() > 10_000);
    assert_eq!(store.delete_bucket(JOB, "b").unwrap(), 0);
    store.create_bucket(JOB, "b").unwrap();
    assert!(matches!(
        write.commit().await,
        Err(StoreError::BucketNotFound { .. })
    ));
    assert_eq!(store.used_bytes(), 0);
    assert!(store.is_empty());
    assert!(matches!(
        store.read_block(JOB, "b", "k", 1, 1, 0, 1).await,
        Err(StoreError::BlockNotFound { .. })
    ));
}

async fn futures_are_send(tier: Tier) {
    let (store, _dir) = open(tier, 1 << 20, false);
    store.create_bucket(JOB, "b").unwrap();
    let task_store = store.clone();
    let task = tokio::spawn(async move {
        put(&task_store, "b", "k", b"v").await.unwrap();
        let mut write = task_store
            .begin_block(JOB, "b", "k", 1, 1, 1, false)
            .await
            .unwrap();
        write.append(Bytes::from_static(b"z")).await.unwrap();
        write.commit().await.unwrap();
        task_store
            .read_block(JOB, "b", "k", 1, 1, 0, 1)
            .await
            .unwrap()
    });
    assert_eq!(task.await.unwrap(), Bytes::from_static(b"z"));
}

async fn persist_expires_after_its_ttl(tier: Tier) {
    let ttl = Duration::from_secs(60);
    let (store, _dir) = open_with_ttl(tier, ttl);
    assert_eq!(store.persist_ttl(), Some(ttl));
    store.create_bucket(JOB, "b").unwrap();
    let written = Instant::now();
    put_persist(&store, "kept", b"keep", false).await.unwrap();
    put_persist_block(&store).await;
    // Overwritten before it expires: the replaced version's queue entry is stale.
    put_persist(&store, "twice", b"keep", false).await.unwrap();
    put_persist(&store, "twice", b"kep2", true).await.unwrap();
    put(&store, "b", "plain", b"drop").await.unwrap();
    assert_eq!(store.expire_persist(written + ttl / 2, 100), (0, 0));
    store.delete_job(JOB);
    assert_eq!(store.usage().objects, 2);

    // One entry per pass at most, oldest first.
    let later = Instant::now() + ttl;
    assert_eq!(store.expire_persist(later, 1).0, 1);
    assert!(matches!(
        store.get_record(JOB, "b", "kept", false).await,
        Err(StoreError::NotFound { .. })
    ));
    assert_eq!(
        store.read_block(JOB, "b", "big", 9, 1, 0, 3).await.unwrap(),
        Bytes::from_static(b"abc")
    );
    assert_eq!(store.expire_persist(later, 100).0, 2);
    assert_eq!(store.used_bytes(), 0);
    assert!(store.is_empty());
    // The released job's emptied bucket and the job itself are gone.
    assert!(store.usage().per_job.is_empty());
    assert_eq!(store.expire_persist(later, 100), (0, 0));
}

async fn expiry_keeps_the_buckets_of_a_live_job(tier: Tier) {
    let ttl = Duration::from_millis(1);
    let (store, _dir) = open_with_ttl(tier, ttl);
    store.create_bucket(JOB, "b").unwrap();
    put_persist(&store, "k", b"x", false).await.unwrap();
    let (deleted, freed) = store.expire_persist(Instant::now() + ttl, 100);
    assert_eq!(deleted, 1);
    assert!(freed > 0);
    assert_eq!(store.used_bytes(), 0);
    // The job was never deregistered: its bucket stays usable.
    put(&store, "b", "next", b"y").await.unwrap();
    assert_eq!(store.usage().objects, 1);
}

async fn without_a_ttl_persist_never_expires(tier: Tier) {
    let (store, _dir) = open(tier, 1 << 20, true);
    store.create_bucket(JOB, "b").unwrap();
    put_persist(&store, "k", b"x", false).await.unwrap();
    let far = Instant::now() + Duration::from_secs(365 * 24 * 3600);
    assert_eq!(store.expire_persist(far, 100), (0, 0));
    assert_eq!(store.persist_ttl(), None);
    assert_eq!(store.usage().objects, 1);
}

async fn inserts_wake_the_waiters_of_their_keys(tier: Tier) {
    let (store, _dir) = open(tier, 1 << 20, false);
    store.create_bucket(JOB, "b").unwrap();
    let wanted = vec!["k".to_string()];
    let mut waiter = store.waiter(JOB, "b");
    waiter.watch(&wanted);
    assert_eq!(store.missing(JOB, "b", &wanted).unwrap(), wanted);
    put(&store, "b", "other", b"x").await.unwrap();
    assert!(!waiter.try_notified(), "woken by a key it does not watch");
    put(&store, "b", "k", b"x").await.unwrap();
    assert!(waiter.try_notified());
    assert!(store.missing(JOB, "b", &wanted).unwrap().is_empty());
    assert_eq!(store.watched_keys(), 0);
    waiter.watch(&["later".to_string()]);
    assert_eq!(store.watched_keys(), 1);
    store.delete_bucket(JOB, "b").unwrap();
    store.wake_waiters();
    assert!(waiter.try_notified(), "a deleted bucket wakes its readers");
    drop(waiter);
    assert_eq!(store.watched_keys(), 0);
}

async fn ended_leases_free_their_prefixes_now(tier: Tier) {
    let (store, _dir) = open(tier, 1 << 20, true);
    store.create_bucket(JOB, "b").unwrap();
    let p = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    store
        .renew_leases(JOB, &p(&["s1/t0", "s1/t1"]), 60_000)
        .unwrap();
    put(&store, "b", "s1/t0/m0", b"gone").await.unwrap();
    put(&store, "b", "s1/t1/m0", b"kept").await.unwrap();
    put(&store, "b", "s1/t0x", b"not under it").await.unwrap();
    let (ended, freed) = store
        .end_leases(JOB, &p(&["s1/t0", "never-leased"]))
        .unwrap();
    assert_eq!(ended, 1);
    assert!(freed > 0);
    assert!(matches!(
        store.get_record(JOB, "b", "s1/t0/m0", false).await,
        Err(StoreError::NotFound { .. })
    ));
    assert!(store.get_record(JOB, "b", "s1/t1/m0", false).await.is_ok());
    assert!(store.get_record(JOB, "b", "s1/t0x", false).await.is_ok());
    // Ended once: a second end finds no lease.
    assert_eq!(store.end_leases(JOB, &p(&["s1/t0"])).unwrap(), (0, 0));
    assert!(store.end_leases(JOB, &p(&[""])).is_err());
    // A straggler writes under the ended prefix: the ended lease lingers one lease and its
    // lapse frees what was written since.
    put(&store, "b", "s1/t0/late", b"straggler").await.unwrap();
    let far = Instant::now() + Duration::from_secs(3600);
    let lapsed: Vec<(String, bool)> = store
        .expire_leases(far)
        .into_iter()
        .map(|(_, prefix, bytes)| (prefix, bytes > 0))
        .collect();
    assert_eq!(lapsed, vec![("s1/t0".into(), true), ("s1/t1".into(), true)]);
    assert!(matches!(
        store.get_record(JOB, "b", "s1/t0/late", false).await,
        Err(StoreError::NotFound { .. })
    ));
    assert!(store.get_record(JOB, "b", "s1/t0x", false).await.is_ok());
}

/// A write-once fence is a record of no bytes with its flag: write-once against objects and
/// other fences, replaced by an overwrite, readable and deletable as a record (clients read
/// through it), but left out of listings and notifications.
async fn fences_hold_a_key_without_being_an_object(tier: Tier) {
    let (store, _dir) = open(tier, 1 << 20, false);
    store.create_bucket(JOB, "b").unwrap();
    let id = store
        .events()
        .subscribe(JOB, "b", "", &[EventOp::Put, EventOp::Delete], 16)
        .unwrap();
    let fence = ObjectHeader {
        version: 7,
        flags: HEADER_FLAG_FENCE,
        ..Default::default()
    };
    let put_fence = |key: &'static str| store.put_record(JOB, "b", key, fence, Bytes::new(), false);
    put_fence("f").await.unwrap();
    assert!(matches!(
        put(&store, "b", "f", b"late").await,
        Err(StoreError::AlreadyExists { .. })
    ));
    put(&store, "b", "o", b"first").await.unwrap();
    assert!(matches!(
        put_fence("o").await,
        Err(StoreError::AlreadyExists { .. })
    ));
    let (header, bytes) = store.get_record(JOB, "b", "f", false).await.unwrap();
    assert!(header.fence() && header.version == 7 && bytes.is_empty());
    let (page, _) = store.enumerate(JOB, "b", "", None, 10).unwrap();
    assert_eq!(
        page,
        vec![("o".to_string(), 5)],
        "a fence is listed as no object"
    );
    // An overwrite replaces a fence, and says it did.
    let replaced = store
        .put_record(
            JOB,
            "b",
            "f",
            small(8, b"over"),
            Bytes::from_static(b"over"),
            true,
        )
        .await
        .unwrap();
    assert!(replaced.is_some_and(|h| h.fence()));
    put_fence("g").await.unwrap();
    assert!(store
        .delete_record_version(JOB, "b", "g", Some(7))
        .unwrap()
        .fence());
    put_fence("h").await.unwrap();
    assert!(store
        .get_record(JOB, "b", "h", true)
        .await
        .unwrap()
        .0
        .fence());
    let (events, _) = store
        .events()
        .poll(JOB, id, 16, Duration::ZERO, None)
        .await
        .unwrap();
    let seen: Vec<(EventOp, &str)> = events.iter().map(|e| (e.op, e.key.as_str())).collect();
    assert_eq!(seen, [(EventOp::Put, "o"), (EventOp::Put, "f")]);
}

/// A DELETE read with `Claim::Whole` takes only a record whose bytes go with it: a small object,
/// or one of one data block held here whole that fits the reader; a striped manifest stays.
async fn claim_whole_leaves_striped_manifests(tier: Tier) {
    let (store, _dir) = open(tier, 8 << 20, false);
    store.create_bucket(JOB, "b").unwrap();
    let whole = Claim::Whole {
        inline_bytes_max: 1 << 20,
    };
    put(&store, "b", "small", b"hi").await.unwrap();
    let (_, value, claimed) = store
        .get_record_claiming(JOB, "b", "small", whole)
        .await
        .unwrap();
    assert!(claimed);
    assert_eq!(&value[..], b"hi");
    assert!(store.lookup(JOB, "b", "small").is_err());
    let striped = manifest(2, 3 << 10, 1 << 10);
    store
        .put_record(JOB, "b", "striped", striped, Bytes::new(), false)
        .await
        .unwrap();
    for _ in 0..2 {
        let (header, _, claimed) = store
            .get_record_claiming(JOB, "b", "striped", whole)
            .await
            .unwrap();
        assert!(!claimed);
        assert_eq!(header, striped);
    }
    // The reader takes it afterwards by its version.
    store
        .delete_record_version(JOB, "b", "striped", Some(2))
        .unwrap();
    // One data block: taken when held here whole and it fits, else left for the block read.
    let one = manifest(3, 1000, 1 << 10);
    for key in ["held", "elsewhere", "too-big"] {
        store
            .put_record(JOB, "b", key, one, Bytes::new(), false)
            .await
            .unwrap();
    }
    put_block(&store, "held", 3, 1, &pattern(1000, 1))
        .await
        .unwrap();
    put_block(&store, "too-big", 3, 1, &pattern(1000, 2))
        .await
        .unwrap();
    let taken = |key: &'static str, inline_bytes_max: u64| {
        let store = &store;
        async move {
            store
                .get_record_claiming(JOB, "b", key, Claim::Whole { inline_bytes_max })
                .await
                .unwrap()
                .2
        }
    };
    assert!(taken("held", 1000).await);
    assert!(!taken("elsewhere", 1000).await);
    assert!(!taken("too-big", 999).await);
    assert!(store.lookup(JOB, "b", "elsewhere").is_ok());
    assert!(store.lookup(JOB, "b", "too-big").is_ok());
}

macro_rules! per_tier {
    ($($name:ident),* $(,)?) => {
        mod dram {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Tier::Dram).await })*
        }
        mod nvme {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Tier::Nvme).await })*
        }
    };
}

per_tier!(
    small_objects_round_trip,
    write_once_and_overwrite,
    invalid_puts_are_refused,
    persist_on_long_running,
    data_blocks,
    exhaustion_leaves_nothing,
    manifests_still_fit_a_tier_full_of_data,
    overflowed_manifests_carry_a_bounded_value,
    concurrent_delete_on_read_has_one_winner,
    jobs_are_isolated,
    enumerate_pages_and_prefixes,
    deleting_a_bucket_under_a_write_leaks_nothing,
    futures_are_send,
    persist_expires_after_its_ttl,
    expiry_keeps_the_buckets_of_a_live_job,
    without_a_ttl_persist_never_expires,
    inserts_wake_the_waiters_of_their_keys,
    ended_leases_free_their_prefixes_now,
    fences_hold_a_key_without_being_an_object,
    claim_whole_leaves_striped_manifests,
);
