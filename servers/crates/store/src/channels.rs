//! FIFO queues and append files: channels between tasks, kept per bucket beside its objects.
//!
//! Both are kept in *segments* addressed by `(name, segment index)`; a client chains segments
//! (0, 1, 2, ...) over servers so one channel can outgrow one server. A segment is *sealed*
//! when it is full or its server has no room left; writers then go on in the next segment, and
//! readers move on once a sealed segment has nothing more for them. Segments are freed with
//! their bucket, with a prefix of their name (`delete_prefix`, lease expiry) and with their job.
//!
//! Every item and record is stored through the engine and charged like an object; a segment
//! itself is charged one index entry plus its name, so the number of segments is bounded by the
//! capacity too.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use pocketflow_protocol::limits::{
    APPEND_READ_MAX_BYTES, APPEND_SEGMENT_MAX_BYTES, CHANNEL_WAIT_MAX_MS, QUEUE_ITEMS_MAX,
    SMALL_OBJECT_MAX_BYTES,
};

use crate::capacity::{Charge, ChargeKind, JobAccount, INDEX_ENTRY_OVERHEAD_BYTES};
use crate::delivery::Undelivered;
use crate::error::StoreError;
use crate::events::EventOp;
use crate::index::{BucketIndex, Stored};
use crate::store::Store;

/// Address of a segment within a bucket; sorts by name first, so prefixes are ranges.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct SegmentKey {
    pub name: String,
    pub segment: u32,
}

/// One segment of a FIFO queue.
#[derive(Debug)]
pub(crate) struct QueueSegment {
    items: VecDeque<Arc<Stored>>,
    max_items: u32,
    sealed: bool,
    charge: Charge,
}

/// One segment of an append file: records back to back, each at its byte offset.
#[derive(Debug)]
pub(crate) struct AppendSegment {
    records: Vec<(u64, Arc<Stored>)>,
    len_bytes: u64,
    bound_bytes: u64,
    sealed: bool,
    charge: Charge,
}

/// A queue segment as an op left it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueState {
    /// Whether the segment exists.
    pub exists: bool,
    /// Items in it.
    pub items: u64,
    /// Its bound.
    pub max_items: u32,
    /// Whether it is sealed.
    pub sealed: bool,
}

/// An append-file segment as an op left it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AppendState {
    /// Whether the segment exists.
    pub exists: bool,
    /// Bytes of records in it.
    pub len_bytes: u64,
    /// Records in it.
    pub records: u64,
    /// Whether it is sealed.
    pub sealed: bool,
}

impl QueueSegment {
    /// Put an item taken from this segment back at its head (see [`crate::delivery`]).
    pub(crate) fn put_back(&mut self, item: Arc<Stored>) {
        self.items.push_front(item);
    }

    fn state(&self) -> QueueState {
        QueueState {
            exists: true,
            items: self.items.len() as u64,
            max_items: self.max_items,
            sealed: self.sealed,
        }
    }
}

impl AppendSegment {
    fn state(&self) -> AppendState {
        AppendState {
            exists: true,
            len_bytes: self.len_bytes,
            records: self.records.len() as u64,
            sealed: self.sealed,
        }
    }
}

/// Uncount removed segments and their items from `account`; returns the bytes charged to them
/// (freed when the caller drops them, unless a reader still holds an item).
pub(crate) fn forget_channels<'a>(
    account: &JobAccount,
    queues: impl IntoIterator<Item = (&'a SegmentKey, &'a QueueSegment)>,
    appends: impl IntoIterator<Item = (&'a SegmentKey, &'a AppendSegment)>,
) -> u64 {
    let mut entries = 0u64;
    let mut bytes = 0u64;
    for (_, queue) in queues {
        entries += 1 + queue.items.len() as u64;
        bytes += queue.charge.bytes() + queue.items.iter().map(|s| s.charge.bytes()).sum::<u64>();
    }
    for (_, file) in appends {
        entries += 1 + file.records.len() as u64;
        bytes += file.charge.bytes()
            + file
                .records
                .iter()
                .map(|(_, s)| s.charge.bytes())
                .sum::<u64>();
    }
    account.entries.fetch_sub(entries, Ordering::AcqRel);
    account.channel_entries.fetch_sub(entries, Ordering::AcqRel);
    bytes
}

fn check_wait(wait_ms: u64) -> Result<Duration, StoreError> {
    if wait_ms > CHANNEL_WAIT_MAX_MS {
        return Err(StoreError::InvalidChannelArgument {
            what: "wait_ms",
            value: wait_ms,
            min: 0,
            max: CHANNEL_WAIT_MAX_MS,
        });
    }
    Ok(Duration::from_millis(wait_ms))
}

fn check_range(what: &'static str, value: u64, min: u64, max: u64) -> Result<(), StoreError> {
    if value < min || value > max {
        return Err(StoreError::InvalidChannelArgument {
            what,
            value,
            min,
            max,
        });
    }
    Ok(())
}

/// The key parked ops of a queue segment watch.
pub(crate) fn watch_key(name: &str, segment: u32) -> String {
    format!("{name}\u{0}{segment}")
}

fn sealed(name: &str, segment: u32) -> StoreError {
    StoreError::Sealed {
        name: name.to_string(),
        segment,
    }
}

impl Store {
    /// Charge a new segment's index entry to `account`.
    fn segment_charge(&self, account: &Arc<JobAccount>, name: &str) -> Result<Charge, StoreError> {
        let charge = self.budget().charge(
            account,
            INDEX_ENTRY_OVERHEAD_BYTES + name.len() as u64,
            ChargeKind::Data,
        )?;
        account.entries.fetch_add(1, Ordering::AcqRel);
        account.channel_entries.fetch_add(1, Ordering::AcqRel);
        Ok(charge)
    }

    /// The queue segment `key` of a locked bucket, created with `max_items` if absent.
    fn queue_segment<'a>(
        &self,
        b: &'a mut BucketIndex,
        account: &Arc<JobAccount>,
        key: &SegmentKey,
        max_items: u32,
    ) -> Result<&'a mut QueueSegment, StoreError> {
        if !b.queues.contains_key(key) {
            let charge = self.segment_charge(account, &key.name)?;
            b.queues.insert(
                key.clone(),
                QueueSegment {
                    items: VecDeque::new(),
                    max_items,
                    sealed: false,
                    charge,
                },
            );
        }
        Ok(b.queues.get_mut(key).expect("inserted above"))
    }

    /// Add `item` at the tail of segment `segment` of queue `name`, creating the segment with
    /// bound `max_items` if absent. While the segment is full the op waits up to `wait_ms` for
    /// a dequeue, then fails with `QueueFull`; a sealed segment fails with `Sealed`. Returns the
    /// segment's state after the enqueue.
    #[allow(clippy::too_many_arguments)]
    pub async fn enqueue(
        &self,
        job: &str,
        bucket: &str,
        name: &str,
        segment: u32,
        max_items: u32,
        item: Bytes,
        wait_ms: u64,
    ) -> Result<QueueState, StoreError> {
        crate::store::check_names(job, bucket, Some(name))?;
        check_range(
            "max_items",
            u64::from(max_items),
            1,
            u64::from(QUEUE_ITEMS_MAX),
        )?;
        check_range("item length", item.len() as u64, 0, SMALL_OBJECT_MAX_BYTES)?;
        let deadline = Instant::now() + check_wait(wait_ms)?;
        let key = SegmentKey {
            name: name.to_string(),
            segment,
        };
        // Fail fast on a sealed segment before writing the item.
        self.with_bucket(job, bucket, |b, _| match b.queues.get(&key) {
            Some(q) if q.sealed => Err(sealed(name, segment)),
            _ => Ok(()),
        })?;
        let (job_index, _) = self.bucket(job, bucket)?;
        let stored = self
            .store_bytes(&job_index.account, name, item, false, ChargeKind::Data)
            .await?;
        let (items_waiters, space_waiters) = self.queue_waiters();
        let watched = [watch_key(name, segment)];
        let mut waiter = None;
        loop {
            if let Some(waiter) = waiter.as_mut() {
                crate::waiters::Waiter::watch(waiter, &watched);
            }
            let outcome = self.with_bucket(job, bucket, |b, account| {
                let queue = self.queue_segment(b, account, &key, max_items)?;
                if queue.sealed {
                    return Err(sealed(name, segment));
                }
                if queue.items.len() >= queue.max_items as usize {
                    return Ok(None);
                }
                queue.items.push_back(Arc::clone(&stored));
                account.entries.fetch_add(1, Ordering::AcqRel);
                account.channel_entries.fetch_add(1, Ordering::AcqRel);
                let state = queue.state();
                self.events().emit(job, bucket, name, EventOp::Enqueue);
                Ok(Some(state))
            })?;
            if let Some(state) = outcome {
                items_waiters.inserted(job, bucket, &watched[0]);
                return Ok(state);
            }
            let now = Instant::now();
            if now >= deadline {
                let max_items = self.with_bucket(job, bucket, |b, _| {
                    Ok(b.queues.get(&key).map_or(max_items, |q| q.max_items))
                })?;
                return Err(StoreError::QueueFull {
                    name: name.to_string(),
                    segment,
                    max_items,
                });
            }
            match waiter.as_mut() {
                // Watch first, then check again: a dequeue in between is not missed.
                None => {
                    let mut fresh = self.waiter_on(space_waiters, job, bucket);
                    fresh.watch(&watched);
                    waiter = Some(fresh);
                }
                Some(parked) => {
                    let _ = tokio::time::timeout(deadline - now, parked.notified()).await;
                }
            }
        }
    }

    /// Take the item at the head of segment `segment` of queue `name`. An empty segment that is
    /// not sealed is waited on up to `wait_ms` (an absent one too: a producer may create it).
    /// Returns the item (`None` when the wait passed, or at once when the segment is sealed and
    /// empty) and the segment's state after the dequeue.
    ///
    /// The item comes with its [`Undelivered`] guard, made at the pop: if this future is dropped
    /// before it returns (while an NVMe read of the item is in the kernel, say), or the guard is
    /// dropped before [`Undelivered::delivered`], the item goes back to the segment's head.
    pub async fn dequeue(
        &self,
        job: &str,
        bucket: &str,
        name: &str,
        segment: u32,
        wait_ms: u64,
    ) -> Result<(Option<(Bytes, Undelivered)>, QueueState), StoreError> {
        crate::store::check_names(job, bucket, Some(name))?;
        let deadline = Instant::now() + check_wait(wait_ms)?;
        let key = SegmentKey {
            name: name.to_string(),
            segment,
        };
        let (items_waiters, space_waiters) = self.queue_waiters();
        let watched = [watch_key(name, segment)];
        let mut waiter = None;
        loop {
            if let Some(waiter) = waiter.as_mut() {
                crate::waiters::Waiter::watch(waiter, &watched);
            }
            let taken = self.with_bucket(job, bucket, |b, account| {
                let Some(queue) = b.queues.get_mut(&key) else {
                    return Ok((None, QueueState::default()));
                };
                let item = queue.items.pop_front();
                let state = queue.state();
                if item.is_some() {
                    account.entries.fetch_sub(1, Ordering::AcqRel);
                    account.channel_entries.fetch_sub(1, Ordering::AcqRel);
                    self.events().emit(job, bucket, name, EventOp::Dequeue);
                }
                Ok((item, state))
            })?;
            match taken {
                (Some(stored), state) => {
                    // Before any await: from here on, a cancelled dequeue puts the item back.
                    let taken = Undelivered::new(self, job, bucket, &key, Arc::clone(&stored));
                    space_waiters.inserted(job, bucket, &watched[0]);
                    let len = stored.block.as_ref().map_or(0, |block| block.len());
                    let bytes = self.read_stored(stored, 0, len).await?;
                    return Ok((Some((bytes, taken)), state));
                }
                (None, state) if state.sealed => return Ok((None, state)),
                (None, state) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Ok((None, state));
                    }
                    match waiter.as_mut() {
                        None => {
                            let mut fresh = self.waiter_on(items_waiters, job, bucket);
                            fresh.watch(&watched);
                            waiter = Some(fresh);
                        }
                        Some(parked) => {
                            let _ = tokio::time::timeout(deadline - now, parked.notified()).await;
                        }
                    }
                }
            }
        }
    }

    /// The state of segment `segment` of queue `name`; with `seal`, seal it first (creating it
    /// sealed, with bound `max_items`, if absent) and wake the ops parked on it.
    pub fn queue_info(
        &self,
        job: &str,
        bucket: &str,
        name: &str,
        segment: u32,
        seal: bool,
        max_items: u32,
    ) -> Result<QueueState, StoreError> {
        crate::store::check_names(job, bucket, Some(name))?;
        let key = SegmentKey {
            name: name.to_string(),
            segment,
        };
        let state = self.with_bucket(job, bucket, |b, account| {
            if seal {
                let queue =
                    self.queue_segment(b, account, &key, max_items.clamp(1, QUEUE_ITEMS_MAX))?;
                queue.sealed = true;
                return Ok(queue.state());
            }
            Ok(b.queues
                .get(&key)
                .map(QueueSegment::state)
                .unwrap_or_default())
        })?;
        if seal {
            let (items_waiters, space_waiters) = self.queue_waiters();
            let watched = watch_key(name, segment);
            items_waiters.inserted(job, bucket, &watched);
            space_waiters.inserted(job, bucket, &watched);
        }
        Ok(state)
    }

    /// Append `record` (1..=`SMALL_OBJECT_MAX_BYTES` bytes) whole to segment `segment` of
    /// append file `name`, creating the segment with room for `bound_bytes` if absent. A record
    /// that does not fit seals the segment and fails with `Sealed` (as does a sealed segment).
    /// Returns the record's byte offset and index in the segment.
    pub async fn append(
        &self,
        job: &str,
        bucket: &str,
        name: &str,
        segment: u32,
        bound_bytes: u64,
        record: Bytes,
    ) -> Result<(u64, u64), StoreError> {
        crate::store::check_names(job, bucket, Some(name))?;
        check_range("segment bound", bound_bytes, 1, APPEND_SEGMENT_MAX_BYTES)?;
        let len = record.len() as u64;
        check_range(
            "record length",
            len,
            1,
            SMALL_OBJECT_MAX_BYTES.min(bound_bytes),
        )?;
        let key = SegmentKey {
            name: name.to_string(),
            segment,
        };
        // Fail fast before writing the record; a record that cannot fit seals the segment.
        self.with_bucket(job, bucket, |b, _| match b.appends.get_mut(&key) {
            Some(f) if f.sealed || f.len_bytes + len > f.bound_bytes => {
                f.sealed = true;
                Err(sealed(name, segment))
            }
            _ => Ok(()),
        })?;
        let (job_index, _) = self.bucket(job, bucket)?;
        let stored = self
            .store_bytes(&job_index.account, name, record, false, ChargeKind::Data)
            .await?;
        self.with_bucket(job, bucket, |b, account| {
            if !b.appends.contains_key(&key) {
                let charge = self.segment_charge(account, name)?;
                b.appends.insert(
                    key.clone(),
                    AppendSegment {
                        records: Vec::new(),
                        len_bytes: 0,
                        bound_bytes,
                        sealed: false,
                        charge,
                    },
                );
            }
            let file = b.appends.get_mut(&key).expect("inserted above");
            if file.sealed {
                return Err(sealed(name, segment));
            }
            if file.len_bytes + len > file.bound_bytes {
                file.sealed = true;
                return Err(sealed(name, segment));
            }
            let offset = file.len_bytes;
            file.records.push((offset, stored));
            file.len_bytes += len;
            account.entries.fetch_add(1, Ordering::AcqRel);
            account.channel_entries.fetch_add(1, Ordering::AcqRel);
            Ok((offset, file.records.len() as u64 - 1))
        })
    }

    /// Seal segment `segment` of append file `name` (creating it sealed and empty if absent);
    /// returns its state.
    pub fn seal_append(
        &self,
        job: &str,
        bucket: &str,
        name: &str,
        segment: u32,
    ) -> Result<AppendState, StoreError> {
        crate::store::check_names(job, bucket, Some(name))?;
        let key = SegmentKey {
            name: name.to_string(),
            segment,
        };
        self.with_bucket(job, bucket, |b, account| {
            if !b.appends.contains_key(&key) {
                let charge = self.segment_charge(account, name)?;
                b.appends.insert(
                    key.clone(),
                    AppendSegment {
                        records: Vec::new(),
                        len_bytes: 0,
                        bound_bytes: 1,
                        sealed: false,
                        charge,
                    },
                );
            }
            let file = b.appends.get_mut(&key).expect("inserted above");
            file.sealed = true;
            Ok(file.state())
        })
    }

    /// Up to `max_bytes` (at most `APPEND_READ_MAX_BYTES`) bytes of segment `segment` of append
    /// file `name` from byte `offset`, cut at the segment's end, and the segment's state (an
    /// absent segment reads as empty and not existing).
    pub async fn read_append(
        &self,
        job: &str,
        bucket: &str,
        name: &str,
        segment: u32,
        offset: u64,
        max_bytes: u32,
    ) -> Result<(Bytes, AppendState), StoreError> {
        crate::store::check_names(job, bucket, Some(name))?;
        check_range(
            "read length",
            u64::from(max_bytes),
            0,
            u64::from(APPEND_READ_MAX_BYTES),
        )?;
        let key = SegmentKey {
            name: name.to_string(),
            segment,
        };
        let end = offset.saturating_add(u64::from(max_bytes));
        let (pieces, state) = self.with_bucket(job, bucket, |b, _| {
            let Some(file) = b.appends.get(&key) else {
                return Ok((Vec::new(), AppendState::default()));
            };
            // The first record that ends after `offset`.
            let first = file
                .records
                .partition_point(|(at, s)| at + s.block.as_ref().map_or(0, |b| b.len()) <= offset);
            let pieces: Vec<(Arc<Stored>, u64, u64)> = file.records[first..]
                .iter()
                .take_while(|(at, _)| *at < end)
                .map(|(at, stored)| {
                    let len = stored.block.as_ref().map_or(0, |b| b.len());
                    let from = offset.saturating_sub(*at);
                    let to = (end - at).min(len);
                    (Arc::clone(stored), from, to - from)
                })
                .collect();
            Ok((pieces, file.state()))
        })?;
        let total: u64 = pieces.iter().map(|(_, _, len)| len).sum();
        let mut out = BytesMut::with_capacity(total as usize);
        for (stored, from, len) in pieces {
            out.put(self.read_stored(stored, from, len).await?);
        }
        Ok((out.freeze(), state))
    }

    /// Whole records of segment `segment` of append file `name` from record `first`, each as
    /// `u32 length (LE)` and its bytes, as many as fit in `max_bytes` (at most
    /// `APPEND_READ_MAX_BYTES`; at least one record if any follows). Returns them, how many,
    /// and the segment's state.
    pub async fn read_records(
        &self,
        job: &str,
        bucket: &str,
        name: &str,
        segment: u32,
        first: u64,
        max_bytes: u32,
    ) -> Result<(Bytes, u64, AppendState), StoreError> {
        crate::store::check_names(job, bucket, Some(name))?;
        check_range(
            "read length",
            u64::from(max_bytes),
            1,
            u64::from(APPEND_READ_MAX_BYTES),
        )?;
        let key = SegmentKey {
            name: name.to_string(),
            segment,
        };
        let (records, state) = self.with_bucket(job, bucket, |b, _| {
            let Some(file) = b.appends.get(&key) else {
                return Ok((Vec::new(), AppendState::default()));
            };
            let mut taken = Vec::new();
            let mut bytes = 0u64;
            for (_, stored) in file.records.iter().skip(first as usize) {
                let len = 4 + stored.block.as_ref().map_or(0, |b| b.len());
                if !taken.is_empty() && bytes + len > u64::from(max_bytes) {
                    break;
                }
                bytes += len;
                taken.push(Arc::clone(stored));
            }
            Ok((taken, file.state()))
        })?;
        let count = records.len() as u64;
        let mut out = BytesMut::new();
        for stored in records {
            let len = stored.block.as_ref().map_or(0, |b| b.len());
            out.put_u32_le(len as u32);
            out.put(self.read_stored(stored, 0, len).await?);
        }
        Ok((out.freeze(), count, state))
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use crate::engine::Tier;
    use crate::store::{Store, StoreConfig};

    use super::*;

    fn store() -> Store {
        let store = Store::open(StoreConfig {
            tier: Tier::Dram,
            capacity_bytes: 8 * 1024 * 1024,
            ..Default::default()
        })
        .unwrap();
        store.create_bucket("j", "b").unwrap();
        store
    }

    #[tokio::test]
    async fn a_queue_is_fifo_bounded_and_freed_with_its_prefix() {
        let s = store();
        for i in 0..3u8 {
            let state = s
                .enqueue("j", "b", "q/1", 0, 3, Bytes::from(vec![i; 10]), 0)
                .await
                .unwrap();
            assert_eq!(state.items, u64::from(i) + 1);
        }
        let full = s
            .enqueue("j", "b", "q/1", 0, 3, Bytes::from_static(b"x"), 20)
            .await;
        assert!(matches!(
            full,
            Err(StoreError::QueueFull { max_items: 3, .. })
        ));
        let (item, state) = s.dequeue("j", "b", "q/1", 0, 0).await.unwrap();
        let (item, taken) = item.unwrap();
        taken.delivered();
        assert_eq!(item, Bytes::from(vec![0u8; 10]));
        drop(item);
        assert_eq!(state.items, 2);
        assert!(s.used_bytes() > 0);
        // The segment and its two items are channel entries: a server holding them is not
        // empty, though it holds no object.
        let usage = s.usage();
        assert_eq!((usage.objects, usage.channel_entries), (0, 3));
        assert_eq!(usage.per_job["j"].channel_entries, 3);
        assert!(!s.is_empty());
        let (deleted, freed) = s.delete_prefix("j", "b", "q/").unwrap();
        assert_eq!(deleted, 0, "queues are not objects");
        assert!(freed > 0);
        assert_eq!(s.used_bytes(), 0);
        assert_eq!(s.usage().channel_entries, 0);
        assert!(s.is_empty());
        let (none, state) = s.dequeue("j", "b", "q/1", 0, 0).await.unwrap();
        assert!(none.is_none() && !state.exists);
    }

    #[tokio::test]
    async fn a_parked_dequeue_gets_the_next_enqueue_and_a_seal_releases_it() {
        let s = store();
        let consumer = {
            let s = s.clone();
            tokio::spawn(async move { s.dequeue("j", "b", "q", 0, 5_000).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        s.enqueue("j", "b", "q", 0, 8, Bytes::from_static(b"hi"), 0)
            .await
            .unwrap();
        let (item, _) = consumer.await.unwrap().unwrap();
        let (item, taken) = item.unwrap();
        taken.delivered();
        assert_eq!(item, Bytes::from_static(b"hi"));
        let parked = {
            let s = s.clone();
            tokio::spawn(async move { s.dequeue("j", "b", "q", 0, 5_000).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let started = Instant::now();
        s.queue_info("j", "b", "q", 0, true, 8).unwrap();
        let (item, state) = parked.await.unwrap().unwrap();
        assert!(item.is_none() && state.sealed);
        assert!(started.elapsed() < Duration::from_secs(2));
        let refused = s
            .enqueue("j", "b", "q", 0, 8, Bytes::from_static(b"x"), 0)
            .await;
        assert!(matches!(refused, Err(StoreError::Sealed { .. })));
    }

    #[tokio::test]
    async fn an_undelivered_item_goes_back_to_the_head_of_its_queue() {
        let s = store();
        for item in [b"first", b"secnd"] {
            s.enqueue("j", "b", "q", 0, 2, Bytes::from_static(item), 0)
                .await
                .unwrap();
        }
        let used = s.used_bytes();
        let (item, state) = s.dequeue("j", "b", "q", 0, 0).await.unwrap();
        assert_eq!(state.items, 1);
        let (bytes, taken) = item.unwrap();
        assert_eq!(bytes, Bytes::from_static(b"first"));
        // The reply never went out: the item is first in line again, nothing charged twice.
        drop((bytes, taken));
        assert_eq!(s.queue_info("j", "b", "q", 0, false, 2).unwrap().items, 2);
        assert_eq!(s.used_bytes(), used);
        for expected in [b"first", b"secnd"] {
            let (item, _) = s.dequeue("j", "b", "q", 0, 0).await.unwrap();
            let (bytes, taken) = item.unwrap();
            taken.delivered();
            assert_eq!(bytes, Bytes::from_static(expected));
        }
        assert_eq!(s.queue_info("j", "b", "q", 0, false, 2).unwrap().items, 0);
        // A parked dequeue is woken by an item put back.
        s.enqueue("j", "b", "q", 0, 2, Bytes::from_static(b"again"), 0)
            .await
            .unwrap();
        let (item, _) = s.dequeue("j", "b", "q", 0, 0).await.unwrap();
        let (_, taken) = item.unwrap();
        let parked = {
            let s = s.clone();
            tokio::spawn(async move { s.dequeue("j", "b", "q", 0, 5_000).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(taken);
        let (item, _) = parked.await.unwrap().unwrap();
        let (bytes, taken) = item.expect("the parked dequeue got the item put back");
        taken.delivered();
        assert_eq!(bytes, Bytes::from_static(b"again"));
        drop(bytes);
        // An item whose queue was freed meanwhile is freed with it.
        s.enqueue("j", "b", "q", 0, 2, Bytes::from_static(b"gone"), 0)
            .await
            .unwrap();
        let (item, _) = s.dequeue("j", "b", "q", 0, 0).await.unwrap();
        s.delete_prefix("j", "b", "q").unwrap();
        drop(item);
        assert_eq!(s.used_bytes(), 0);
        assert!(s.is_empty());
    }

    /// A dequeue dropped while the NVMe read of its item is in the kernel leaves the item in its
    /// queue. On a current-thread runtime the first poll submits the read and returns pending
    /// (the reaper task cannot run in between), so dropping the future then cuts the read short.
    #[tokio::test]
    async fn a_dequeue_cancelled_during_its_nvme_read_loses_nothing() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let s = Store::open(StoreConfig {
            tier: Tier::Nvme,
            capacity_bytes: 8 * 1024 * 1024,
            nvme_path: Some(dir.path().join("blocks")),
            ..Default::default()
        })
        .unwrap();
        s.create_bucket("j", "b").unwrap();
        let item = Bytes::from(vec![7u8; 60_000]);
        s.enqueue("j", "b", "q", 0, 4, item.clone(), 0)
            .await
            .unwrap();
        let mut dequeue = Box::pin(s.dequeue("j", "b", "q", 0, 0));
        let mut context = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(
            dequeue.as_mut().poll(&mut context).is_pending(),
            "the first poll must stop at the NVMe read"
        );
        drop(dequeue);
        assert_eq!(s.queue_info("j", "b", "q", 0, false, 4).unwrap().items, 1);
        let (got, _) = s.dequeue("j", "b", "q", 0, 0).await.unwrap();
        let (bytes, taken) = got.expect("the item is still in its queue");
        taken.delivered();
        assert_eq!(bytes, item);
    }

    #[tokio::test]
    async fn appends_are_whole_and_a_full_segment_seals() {
        let s = store();
        let (at, index) = s
            .append("j", "b", "f", 0, 10, Bytes::from_static(b"abcd"))
            .await
            .unwrap();
        assert_eq!((at, index), (0, 0));
        let (at, index) = s
            .append("j", "b", "f", 0, 10, Bytes::from_static(b"efgh"))
            .await
            .unwrap();
        assert_eq!((at, index), (4, 1));
        let over = s
            .append("j", "b", "f", 0, 10, Bytes::from_static(b"ijk"))
            .await;
        assert!(matches!(over, Err(StoreError::Sealed { .. })));
        let (bytes, state) = s.read_append("j", "b", "f", 0, 2, 5).await.unwrap();
        assert_eq!(&bytes[..], b"cdefg");
        assert!(state.sealed && state.len_bytes == 8 && state.records == 2);
        let (records, count, _) = s.read_records("j", "b", "f", 0, 1, 1024).await.unwrap();
        assert_eq!(count, 1);
        assert_eq!(&records[..], b"\x04\x00\x00\x00efgh");
        assert_eq!(
            s.usage().channel_entries,
            3,
            "the segment and its two records"
        );
        s.delete_bucket("j", "b").unwrap();
        assert_eq!(s.used_bytes(), 0);
        assert_eq!(s.usage().channel_entries, 0);
    }
}
