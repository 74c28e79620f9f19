//! The PERSIST expiry sweeper: a background task that frees PERSIST objects past their TTL.

use std::time::{Duration, Instant};

use pocketflow_flight::StorageService;
use pocketflow_store::Store;

/// How often the sweeper looks for expired PERSIST entries.
pub const PERSIST_SWEEP_INTERVAL_MS: u64 = 250;

/// Most PERSIST entries (records and data blocks) freed per pass, so one pass stays short; the
/// rest wait for the next pass.
pub const PERSIST_SWEEP_ENTRIES_MAX: usize = 4096;

/// Free expired PERSIST entries every [`PERSIST_SWEEP_INTERVAL_MS`], forever (the task is
/// dropped with the runtime), counting them in `service`'s metrics. Does nothing for a store
/// whose PERSIST entries never expire.
pub async fn run(store: Store, service: StorageService) {
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
