//! The PERSIST expiry queue: every PERSIST record and data block, in the order they expire.
//!
//! A server has one PERSIST time-to-live, so entries expire in the order they were written and a
//! FIFO queue is already sorted by deadline. An entry names its index slot and holds a weak
//! reference to what it stored there; an entry whose bytes were already freed (deleted,
//! overwritten, its bucket removed) is stale and skipped. Stale entries are pruned whenever the
//! queue has doubled since the last pruning, so the queue stays within twice the number of live
//! PERSIST entries, which the capacity budget bounds (each costs at least
//! [`crate::INDEX_ENTRY_OVERHEAD_BYTES`]).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::index::{BlockKey, Stored};

/// Fewest queue entries at which stale ones are pruned.
const PRUNE_AT_MIN: usize = 1024;

/// Which index slot an expiry entry names.
#[derive(Clone, Debug)]
pub(crate) enum Slot {
    /// A block-0 record under this key.
    Record(String),
    /// A data block at this address.
    Block(BlockKey),
}

/// One PERSIST entry waiting for its deadline.
#[derive(Debug)]
pub(crate) struct Due {
    pub at: Instant,
    pub job: String,
    pub bucket: String,
    pub slot: Slot,
    pub stored: Weak<Stored>,
}

#[derive(Debug)]
struct Queue {
    entries: VecDeque<Due>,
    prune_at: usize,
}

/// PERSIST entries by deadline, for a server with a PERSIST time-to-live.
#[derive(Debug)]
pub(crate) struct Expiry {
    ttl: Duration,
    queue: Mutex<Queue>,
}

impl Expiry {
    /// An empty queue for entries that live `ttl` after they are written.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            queue: Mutex::new(Queue {
                entries: VecDeque::new(),
                prune_at: PRUNE_AT_MIN,
            }),
        }
    }

    /// The time-to-live of PERSIST entries.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Queue a PERSIST entry just written to `slot`; it expires `ttl` from now.
    pub fn push(&self, job: &str, bucket: &str, slot: Slot, stored: &Arc<Stored>) {
        let due = Due {
            at: Instant::now() + self.ttl,
            job: job.to_string(),
            bucket: bucket.to_string(),
            slot,
            stored: Arc::downgrade(stored),
        };
        let mut queue = self.queue.lock().expect("expiry queue lock poisoned");
        queue.entries.push_back(due);
        if queue.entries.len() >= queue.prune_at {
            queue.entries.retain(|d| d.stored.strong_count() > 0);
            queue.prune_at = (queue.entries.len() * 2).max(PRUNE_AT_MIN);
        }
    }

    /// Take up to `max` entries whose deadline is at or before `now`, oldest first (stale
    /// entries are dropped and not counted).
    pub fn take_due(&self, now: Instant, max: usize) -> Vec<Due> {
        let mut queue = self.queue.lock().expect("expiry queue lock poisoned");
        let mut due = Vec::new();
        // Stale entries count towards a looser bound, so one call stays short.
        let mut popped = 0;
        while due.len() < max && popped < max.saturating_mul(4) {
            popped += 1;
            match queue.entries.front() {
                Some(front) if front.at <= now => {
                    let entry = queue.entries.pop_front().expect("front exists");
                    if entry.stored.strong_count() > 0 {
                        due.push(entry);
                    }
                }
                _ => break,
            }
        }
        due
    }
}
