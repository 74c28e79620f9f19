//! A queue item between its dequeue and its delivery: an item leaves its queue only for a
//! consumer that is still there to receive it.
//!
//! [`Store::dequeue`] pops an item and hands it out with an [`Undelivered`] guard, made at the
//! pop itself, before any await: the read of the item's bytes (an NVMe read is a real wait), the
//! reply that carries it and the write of that reply may each be cut short by a consumer that
//! went away. Whoever sends the reply calls [`Undelivered::delivered`] once it is out; a guard
//! dropped before that (a cancelled dequeue, a reply frame dropped unsent, a write that failed)
//! puts the item back at the head of its segment, where the next dequeue finds it first.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::channels::{watch_key, SegmentKey};
use crate::events::EventOp;
use crate::index::Stored;
use crate::store::Store;

/// A dequeued item not yet delivered; dropped undelivered, it goes back to its queue.
#[must_use = "an item whose guard is dropped goes back to its queue"]
pub struct Undelivered {
    back: Option<PutBack>,
}

/// Where a taken item goes back to.
struct PutBack {
    store: Store,
    job: String,
    bucket: String,
    key: SegmentKey,
    stored: Arc<Stored>,
}

impl Undelivered {
    pub(crate) fn new(
        store: &Store,
        job: &str,
        bucket: &str,
        key: &SegmentKey,
        stored: Arc<Stored>,
    ) -> Self {
        Self {
            back: Some(PutBack {
                store: store.clone(),
                job: job.to_string(),
                bucket: bucket.to_string(),
                key: key.clone(),
                stored,
            }),
        }
    }

    /// The reply carrying the item went out: it stays taken.
    pub fn delivered(mut self) {
        self.back = None;
    }
}

impl std::fmt::Debug for Undelivered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Undelivered")
            .field("armed", &self.back.is_some())
            .finish()
    }
}

impl Drop for Undelivered {
    fn drop(&mut self) {
        if let Some(back) = self.back.take() {
            back.store
                .put_back(&back.job, &back.bucket, &back.key, back.stored);
        }
    }
}

impl Store {
    /// Put a taken item back at the head of its segment, if the segment is still there (a
    /// deleted bucket, prefix or job freed it with the rest); it counts as enqueued again (an
    /// `enqueue` event) and wakes the dequeues parked on the segment. The segment may hold its
    /// bound and one more item for each item put back while producers filled it.
    fn put_back(&self, job: &str, bucket: &str, key: &SegmentKey, stored: Arc<Stored>) {
        let restored = self.with_bucket(job, bucket, |b, account| {
            let Some(queue) = b.queues.get_mut(key) else {
                return Ok(None);
            };
            queue.put_back(stored);
            account.entries.fetch_add(1, Ordering::AcqRel);
            self.events().emit(job, bucket, &key.name, EventOp::Enqueue);
            Ok(Some(()))
        });
        if let Ok(Some(())) = restored {
            let (items_waiters, _) = self.queue_waiters();
            items_waiters.inserted(job, bucket, &watch_key(&key.name, key.segment));
        }
    }
}
