//! Notifications: subscribers of a job's operations on a bucket prefix, each with a bounded
//! buffer of events in this server's order.
//!
//! Every event gets the next sequence number of the server when it is emitted, under the one
//! lock of the subscriptions, so each subscriber sees the server's events in one order. A
//! subscriber whose buffer is full loses its oldest event and counts it; the next poll reports
//! the count. A poll parks until an event arrives (no polling on the wire). With no
//! subscription at all, emitting costs one atomic load.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pocketflow_protocol::limits::{EVENTS_BATCH_MAX, SUBSCRIBER_EVENTS_MAX};
use tokio::sync::Notify;

use crate::error::StoreError;

/// Most subscriptions one server holds (over all jobs).
pub const SUBSCRIPTIONS_MAX: usize = 1024;
/// Most events all subscriptions of a server may keep together (the sum of their capacities),
/// so the buffers' memory is bounded: at most this many events of at most a key, a bucket name
/// and 64 bytes each.
pub const EVENTS_HELD_MAX: usize = 262_144;
/// A subscription nobody polled for this long is dropped (its subscriber went away).
pub const SUBSCRIPTION_IDLE_MS: u64 = 60_000;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventOp {
    /// An object's block-0 record was inserted.
    Put,
    /// An object was deleted (DELETE, or a DELETE-on-read GET).
    Delete,
    /// An item was enqueued.
    Enqueue,
    /// An item was dequeued.
    Dequeue,
    /// A prefix lease lapsed and the prefix was freed (the key is the prefix).
    LeaseExpired,
}

impl EventOp {
    /// Every op, in wire order.
    pub const ALL: [EventOp; 5] = [
        EventOp::Put,
        EventOp::Delete,
        EventOp::Enqueue,
        EventOp::Dequeue,
        EventOp::LeaseExpired,
    ];

    /// The op's wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            EventOp::Put => "put",
            EventOp::Delete => "delete",
            EventOp::Enqueue => "enqueue",
            EventOp::Dequeue => "dequeue",
            EventOp::LeaseExpired => "lease_expired",
        }
    }

    /// The op named `name`.
    pub fn from_name(name: &str) -> Option<EventOp> {
        EventOp::ALL.into_iter().find(|op| op.as_str() == name)
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

/// One event as a subscriber receives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// This server's sequence number of the event (increasing, over all subscribers).
    pub seq: u64,
    /// What happened.
    pub op: EventOp,
    /// Bucket (empty for a lease expiry, which covers every bucket).
    pub bucket: String,
    /// Key, queue name or prefix.
    pub key: String,
}

struct Subscription {
    job: String,
    bucket: String,
    prefix: String,
    ops: u8,
    capacity: usize,
    events: VecDeque<Event>,
    dropped: u64,
    /// The highest sequence number a `keep` poll returned: an event up to it that is pushed out
    /// before it is confirmed was delivered (once at least), so it is not counted as dropped.
    returned: Option<u64>,
    notify: Arc<Notify>,
    polled: Instant,
}

impl Subscription {
    fn wants(&self, job: &str, bucket: &str, key: &str, op: EventOp) -> bool {
        self.ops & op.bit() != 0
            && self.job == job
            && (op == EventOp::LeaseExpired || self.bucket == bucket)
            && key.starts_with(&self.prefix)
    }
}

/// The subscriptions of one server.
#[derive(Default)]
pub struct Events {
    subscriptions: Mutex<HashMap<u64, Subscription>>,
    /// Subscriptions held, so emitting with none skips the lock.
    count: AtomicUsize,
    next_seq: AtomicU64,
    next_id: AtomicU64,
}

impl Events {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Subscription>> {
        self.subscriptions.lock().expect("events lock poisoned")
    }

    /// Record `op` on `key` of `bucket` of `job` for every subscriber that wants it.
    pub fn emit(&self, job: &str, bucket: &str, key: &str, op: EventOp) {
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut subscriptions = self.lock();
        let mut seq = None;
        for sub in subscriptions.values_mut() {
            if !sub.wants(job, bucket, key, op) {
                continue;
            }
            let seq = *seq.get_or_insert_with(|| self.next_seq.fetch_add(1, Ordering::AcqRel));
            if sub.events.len() >= sub.capacity {
                let out = sub.events.pop_front().map(|e| e.seq);
                if out.is_some_and(|seq| sub.returned.is_none_or(|r| seq > r)) {
                    sub.dropped += 1;
                }
            }
            sub.events.push_back(Event {
                seq,
                op,
                bucket: bucket.to_string(),
                key: key.to_string(),
            });
            sub.notify.notify_one();
        }
    }

    /// A new subscription of `job` to `ops` on keys of `bucket` starting with `prefix`, keeping
    /// at most `capacity` (1..=`SUBSCRIBER_EVENTS_MAX`) events; returns its id. Subscriptions
    /// idle for `SUBSCRIPTION_IDLE_MS` are dropped first; at `SUBSCRIPTIONS_MAX` it fails with
    /// `CapacityExhausted`.
    pub fn subscribe(
        &self,
        job: &str,
        bucket: &str,
        prefix: &str,
        ops: &[EventOp],
        capacity: usize,
    ) -> Result<u64, StoreError> {
        if capacity == 0 || capacity > SUBSCRIBER_EVENTS_MAX {
            return Err(StoreError::InvalidChannelArgument {
                what: "capacity",
                value: capacity as u64,
                min: 1,
                max: SUBSCRIBER_EVENTS_MAX as u64,
            });
        }
        let mut subscriptions = self.lock();
        let idle = Duration::from_millis(SUBSCRIPTION_IDLE_MS);
        subscriptions.retain(|_, sub| sub.polled.elapsed() < idle);
        self.count.store(subscriptions.len(), Ordering::Release);
        let held: usize = subscriptions.values().map(|sub| sub.capacity).sum();
        if subscriptions.len() >= SUBSCRIPTIONS_MAX || held + capacity > EVENTS_HELD_MAX {
            return Err(StoreError::TableFull {
                table: "the subscriptions' event buffers",
                requested: capacity as u64,
                available: EVENTS_HELD_MAX.saturating_sub(held) as u64,
                max: EVENTS_HELD_MAX as u64,
            });
        }
        let id = self.next_id.fetch_add(1, Ordering::AcqRel) + 1;
        subscriptions.insert(
            id,
            Subscription {
                job: job.to_string(),
                bucket: bucket.to_string(),
                prefix: prefix.to_string(),
                ops: ops.iter().fold(0, |bits, op| bits | op.bit()),
                capacity,
                events: VecDeque::new(),
                dropped: 0,
                returned: None,
                notify: Arc::new(Notify::new()),
                polled: Instant::now(),
            },
        );
        self.count.store(subscriptions.len(), Ordering::Release);
        Ok(id)
    }

    /// Up to `max` (1..=`EVENTS_BATCH_MAX`) events of subscription `id` of `job`, oldest first,
    /// and how many were lost since the last poll; waits up to `wait` for the first one.
    ///
    /// With `acked` `None` the events returned leave the subscription (a reply that never
    /// reaches the subscriber loses them). With `Some(acked)` the subscriber confirms what it
    /// has: events up to sequence number `acked` (`Some(None)`: nothing yet) leave, and the
    /// events returned stay until a later poll confirms them, so a poll whose reply was lost
    /// (its caller timed out while this server was paused) costs no event: the next poll
    /// returns them again.
    pub async fn poll(
        &self,
        job: &str,
        id: u64,
        max: usize,
        wait: Duration,
        acked: Option<Option<u64>>,
    ) -> Result<(Vec<Event>, u64), StoreError> {
        let max = max.clamp(1, EVENTS_BATCH_MAX);
        let deadline = Instant::now() + wait;
        loop {
            let notify = {
                let mut subscriptions = self.lock();
                let sub = subscriptions
                    .get_mut(&id)
                    .filter(|sub| sub.job == job)
                    .ok_or_else(|| StoreError::NotFound {
                        bucket: String::new(),
                        key: format!("subscription {id}"),
                    })?;
                sub.polled = Instant::now();
                if let Some(Some(acked)) = acked {
                    while sub.events.front().is_some_and(|e| e.seq <= acked) {
                        sub.events.pop_front();
                    }
                }
                if !sub.events.is_empty() || Instant::now() >= deadline {
                    let take = sub.events.len().min(max);
                    let events: Vec<Event> = if acked.is_some() {
                        let events: Vec<Event> = sub.events.iter().take(take).cloned().collect();
                        if let Some(last) = events.last() {
                            sub.returned = sub.returned.max(Some(last.seq));
                        }
                        events
                    } else {
                        sub.events.drain(..take).collect()
                    };
                    let dropped = std::mem::take(&mut sub.dropped);
                    return Ok((events, dropped));
                }
                Arc::clone(&sub.notify)
            };
            // An event (or an unsubscribe) between the check and here is kept as the permit.
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = tokio::time::timeout(left, notify.notified()).await;
        }
    }

    /// End subscription `id` of `job`; a parked poll of it returns `NotFound`.
    pub fn unsubscribe(&self, job: &str, id: u64) -> Result<(), StoreError> {
        let mut subscriptions = self.lock();
        match subscriptions.get(&id) {
            Some(sub) if sub.job == job => {
                let sub = subscriptions.remove(&id).expect("present");
                sub.notify.notify_one();
                self.count.store(subscriptions.len(), Ordering::Release);
                Ok(())
            }
            _ => Err(StoreError::NotFound {
                bucket: String::new(),
                key: format!("subscription {id}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn kept_events_come_again_until_the_subscriber_confirms_them() {
        let events = Events::default();
        let id = events.subscribe("j", "b", "", &[EventOp::Put], 8).unwrap();
        for i in 0..3 {
            events.emit("j", "b", &format!("k{i}"), EventOp::Put);
        }
        let keys = |got: &[Event]| got.iter().map(|e| e.key.clone()).collect::<Vec<_>>();
        // A reply that never arrived: the next poll, confirming nothing yet, has them all.
        let (lost, _) = events
            .poll("j", id, 2, Duration::ZERO, Some(None))
            .await
            .unwrap();
        assert_eq!(keys(&lost), ["k0", "k1"]);
        let (again, _) = events
            .poll("j", id, 8, Duration::ZERO, Some(None))
            .await
            .unwrap();
        assert_eq!(keys(&again), ["k0", "k1", "k2"]);
        // Confirming up to k1 leaves k2; confirming k2 leaves none, and the poll parks.
        let (rest, _) = events
            .poll("j", id, 8, Duration::ZERO, Some(Some(again[1].seq)))
            .await
            .unwrap();
        assert_eq!(keys(&rest), ["k2"]);
        let (none, _) = events
            .poll(
                "j",
                id,
                8,
                Duration::from_millis(20),
                Some(Some(rest[0].seq)),
            )
            .await
            .unwrap();
        assert!(none.is_empty());
        // Without `keep`, a poll takes what it returns.
        events.emit("j", "b", "k3", EventOp::Put);
        let (taken, _) = events.poll("j", id, 8, Duration::ZERO, None).await.unwrap();
        assert_eq!(keys(&taken), ["k3"]);
        let (after, _) = events.poll("j", id, 8, Duration::ZERO, None).await.unwrap();
        assert!(after.is_empty());
        // A returned event pushed out before it is confirmed is not counted as dropped (it was
        // delivered); one never returned is.
        for i in 4..12 {
            events.emit("j", "b", &format!("k{i}"), EventOp::Put);
        }
        let (first, dropped) = events
            .poll("j", id, 8, Duration::ZERO, Some(None))
            .await
            .unwrap();
        assert_eq!((first.len(), dropped), (8, 0));
        for i in 12..16 {
            events.emit("j", "b", &format!("k{i}"), EventOp::Put); // push out k4..k7: returned
        }
        // Out go k8..k11 (returned) and k12, k13 (never returned).
        for i in 16..22 {
            events.emit("j", "b", &format!("k{i}"), EventOp::Put);
        }
        let (_, dropped) = events
            .poll("j", id, 8, Duration::ZERO, Some(None))
            .await
            .unwrap();
        assert_eq!(dropped, 2);
    }

    #[tokio::test]
    async fn a_subscriber_gets_its_events_in_order_and_counts_what_it_lost() {
        let events = Events::default();
        let id = events
            .subscribe("j", "b", "map/", &[EventOp::Put, EventOp::Delete], 3)
            .unwrap();
        events.emit("j", "b", "map/1", EventOp::Put);
        events.emit("j", "b", "red/1", EventOp::Put); // other prefix
        events.emit("j", "c", "map/1", EventOp::Put); // other bucket
        events.emit("k", "b", "map/1", EventOp::Put); // other job
        events.emit("j", "b", "map/1", EventOp::Enqueue); // op not wanted
        events.emit("j", "b", "map/2", EventOp::Delete);
        let (got, dropped) = events
            .poll("j", id, 10, Duration::ZERO, None)
            .await
            .unwrap();
        assert_eq!(dropped, 0);
        assert_eq!(
            got.iter()
                .map(|e| (e.op, e.key.as_str()))
                .collect::<Vec<_>>(),
            [(EventOp::Put, "map/1"), (EventOp::Delete, "map/2")]
        );
        assert!(got[0].seq < got[1].seq);
        for i in 0..5 {
            events.emit("j", "b", &format!("map/{i}"), EventOp::Put);
        }
        let (got, dropped) = events
            .poll("j", id, 10, Duration::ZERO, None)
            .await
            .unwrap();
        assert_eq!(dropped, 2, "capacity 3: the two oldest of five were lost");
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].key, "map/2");
        assert!(events
            .poll("other", id, 1, Duration::ZERO, None)
            .await
            .is_err());
        events.unsubscribe("j", id).unwrap();
        assert!(events.poll("j", id, 1, Duration::ZERO, None).await.is_err());
    }

    #[test]
    fn subscriptions_are_bounded_by_the_events_they_may_hold() {
        let events = Events::default();
        let big = SUBSCRIBER_EVENTS_MAX;
        for _ in 0..EVENTS_HELD_MAX / big {
            events
                .subscribe("j", "b", "", &[EventOp::Put], big)
                .unwrap();
        }
        assert!(matches!(
            events.subscribe("j", "b", "", &[EventOp::Put], 1),
            Err(StoreError::TableFull { .. })
        ));
    }

    #[tokio::test]
    async fn a_parked_poll_wakes_on_the_event() {
        let events = Arc::new(Events::default());
        let id = events.subscribe("j", "b", "", &[EventOp::Put], 16).unwrap();
        let poller = {
            let events = events.clone();
            tokio::spawn(async move {
                events
                    .poll("j", id, 16, Duration::from_secs(10), None)
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let started = Instant::now();
        events.emit("j", "b", "k", EventOp::Put);
        let (got, _) = poller.await.unwrap().unwrap();
        assert_eq!(got.len(), 1);
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
