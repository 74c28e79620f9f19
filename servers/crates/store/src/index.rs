//! The per-server object index: jobs, then buckets, then block-0 records and data blocks, sorted.
//!
//! Locks nest in one order only: the job map, then a job's bucket map, then one bucket. A bucket
//! lock is held only for map operations, never across an await, a copy of object bytes or I/O;
//! entries removed under a lock are dropped after it is released.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use pocketflow_protocol::ObjectHeader;

use crate::capacity::{Charge, JobAccount};
use crate::channels::{AppendSegment, QueueSegment, SegmentKey};
use crate::engine::StoredBlock;

/// Most buckets one job may have on one server.
pub const BUCKETS_PER_JOB_MAX: usize = 4096;
/// Most jobs one server holds data or buckets for.
pub const JOBS_MAX: usize = 65_536;

/// The bytes of an index entry (if any) and what they cost; shared with readers of them.
#[derive(Debug)]
pub(crate) struct Stored {
    /// `None` for an empty value (an empty small object or a manifest).
    pub block: Option<StoredBlock>,
    /// Whether the entry survives `delete_job`.
    pub persist: bool,
    pub charge: Charge,
}

/// A block-0 record: the object's header and its inline bytes.
#[derive(Debug)]
pub(crate) struct Record {
    pub header: ObjectHeader,
    pub stored: Arc<Stored>,
}

/// Address of a data block within a bucket; sorts by key first, so prefixes are ranges.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct BlockKey {
    pub key: String,
    pub version: u64,
    pub index: u32,
}

/// One bucket of one job.
#[derive(Debug, Default)]
pub(crate) struct BucketIndex {
    /// Set when the bucket is removed from its job; writers that raced the removal then fail
    /// with `bucket_not_found` instead of inserting into an orphan.
    pub removed: bool,
    pub records: BTreeMap<String, Record>,
    pub blocks: BTreeMap<BlockKey, Arc<Stored>>,
    /// Queue segments, by queue name and segment index.
    pub queues: BTreeMap<SegmentKey, QueueSegment>,
    /// Append-file segments, by file name and segment index.
    pub appends: BTreeMap<SegmentKey, AppendSegment>,
}

impl BucketIndex {
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
            && self.blocks.is_empty()
            && self.queues.is_empty()
            && self.appends.is_empty()
    }
}

/// Shared handle to one bucket.
pub(crate) type BucketRef = Arc<Mutex<BucketIndex>>;

/// Lock a bucket.
pub(crate) fn lock(bucket: &BucketRef) -> MutexGuard<'_, BucketIndex> {
    bucket.lock().expect("bucket lock poisoned")
}

/// One job's buckets and usage.
#[derive(Debug, Default)]
pub(crate) struct JobIndex {
    pub account: Arc<JobAccount>,
    pub buckets: RwLock<BTreeMap<String, BucketRef>>,
    /// Set by `delete_job` (only PERSIST data is left), cleared by `create_bucket`: buckets that
    /// PERSIST expiry empties are removed only from a released job.
    pub released: AtomicBool,
}

/// Every job of the server.
pub(crate) type JobMap = RwLock<HashMap<String, Arc<JobIndex>>>;

/// Split off the entries of `map` whose keys start with `prefix` (by `key_of`), in O(log n) plus
/// the number of entries moved.
pub(crate) fn split_prefix<K: Ord + Clone, V>(
    map: &mut BTreeMap<K, V>,
    first: &K,
    key_of: impl Fn(&K) -> &str,
    prefix: &str,
) -> BTreeMap<K, V> {
    let mut matched = map.split_off(first);
    let end = matched
        .keys()
        .find(|k| !key_of(k).starts_with(prefix))
        .cloned();
    if let Some(end) = end {
        let mut rest = matched.split_off(&end);
        map.append(&mut rest);
    }
    matched
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_prefix_takes_exactly_the_prefix_range() {
        let mut map: BTreeMap<String, u32> = ["a", "ab", "abc", "abd", "ac", "b"]
            .iter()
            .enumerate()
            .map(|(i, k)| (k.to_string(), i as u32))
            .collect();
        let taken = split_prefix(&mut map, &"ab".to_string(), |k| k.as_str(), "ab");
        assert_eq!(taken.keys().collect::<Vec<_>>(), ["ab", "abc", "abd"]);
        assert_eq!(map.keys().collect::<Vec<_>>(), ["a", "ac", "b"]);
        let all = split_prefix(&mut map, &String::new(), |k| k.as_str(), "");
        assert_eq!(all.len(), 3);
        assert!(map.is_empty());
    }
}
