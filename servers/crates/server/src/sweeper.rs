//! The sweepers: background tasks that free PERSIST objects past their TTL and prefixes whose
//! leases lapsed.

use std::time::{Duration, Instant};

use pocketflow_flight::StorageService;
use pocketflow_store::Store;

/// How often the sweeper looks for expired PERSIST entries.
pub const PERSIST_SWEEP_INTERVAL_MS: u64 = 250;

/// Most PERSIST entries (records and data blocks) freed per pass, so one pass stays short; the
/// rest wait for the next pass.
pub const PERSIST_SWEEP_ENTRIES_MAX: usize = 4096;

/// How often the sweeper frees the prefixes whose leases lapsed (a lapsed prefix is freed at
/// most this long after its lease ends; leases are at least `LEASE_MS_MIN`, 100 ms, long).
pub const LEASE_SWEEP_INTERVAL_MS: u64 = 50;

/// Free lapsed prefix leases every [`LEASE_SWEEP_INTERVAL_MS`], forever.
async fn sweep_leases(store: Store) {
    let mut tick = tokio::time::interval(Duration::from_millis(LEASE_SWEEP_INTERVAL_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        store.expire_leases(Instant::now());
    }
}

/// Free expired PERSIST entries every [`PERSIST_SWEEP_INTERVAL_MS`], forever (the task is
/// dropped with the runtime), counting them in `service`'s metrics, and lapsed prefix leases
/// (on a task of their own). PERSIST entries of a store whose PERSIST entries never expire are
/// left alone.
pub async fn run(store: Store, service: StorageService) {
    tokio::spawn(sweep_leases(store.clone()));
    if store.persist_ttl().is_none() {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_millis(PERSIST_SWEEP_INTERVAL_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (entries, bytes) = store.expire_persist(Instant::now(), PERSIST_SWEEP_ENTRIES_MAX);
        if entries > 0 {
            service.count_ttl_evictions(entries, bytes);
        }
    }
}
