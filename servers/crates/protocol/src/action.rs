//! DoAction names, their JSON request bodies (each with a `ctx`) and their JSON results.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::context::{check_bucket, check_job_id, check_key, check_prefix, parse_json, Context};
use crate::error::ProtocolError;
use crate::header::{ObjectHeader, HEADER_FLAG_PERSIST};
use crate::limits::{
    ENUMERATE_LIMIT_MAX, EPOCH_MAP_MAX_BYTES, EVENTS_BATCH_MAX, LEASE_MS_MAX, LEASE_MS_MIN,
    LEASE_PREFIXES_MAX, SUBSCRIBER_EVENTS_MAX, WAIT_KEYS_MAX, WAIT_TIMEOUT_MAX_MS,
};

/// Every action the server answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActionName {
    /// Header of one object.
    Lookup,
    /// Remove one object's block-0 record.
    Delete,
    /// Free data blocks of one version of an object.
    DeleteBlocks,
    /// List keys of a bucket by prefix, in pages.
    Enumerate,
    /// Create a bucket on this server.
    CreateBucket,
    /// Remove a bucket and every record in it.
    DeleteBucket,
    /// Remove every record of a bucket whose key starts with a prefix.
    DeletePrefix,
    /// Remove every non-PERSIST record of a job.
    DeleteJob,
    /// Set a job's current weight-map epoch (admin).
    SetEpoch,
    /// Server statistics (admin).
    Stats,
    /// Refuse writes from now on, optionally exit once empty (admin).
    Drain,
    /// Limit the server to a number of CPU cores, without restarting it (admin).
    SetCores,
    /// Park until every named key of a bucket exists or a deadline passes.
    Wait,
    /// Subscribe to a job's operations on a bucket prefix.
    Subscribe,
    /// The next events of a subscription (parks until one arrives).
    Events,
    /// End a subscription.
    Unsubscribe,
    /// Renew (or start) prefix leases.
    RenewLeases,
    /// End prefix leases now and free their prefixes.
    EndLeases,
}

impl ActionName {
    /// Every action, in the order of docs/PROTOCOL.md.
    pub const ALL: [ActionName; 18] = [
        ActionName::Lookup,
        ActionName::Delete,
        ActionName::DeleteBlocks,
        ActionName::Enumerate,
        ActionName::CreateBucket,
        ActionName::DeleteBucket,
        ActionName::DeletePrefix,
        ActionName::DeleteJob,
        ActionName::SetEpoch,
        ActionName::Stats,
        ActionName::Drain,
        ActionName::SetCores,
        ActionName::Wait,
        ActionName::Subscribe,
        ActionName::Events,
        ActionName::Unsubscribe,
        ActionName::RenewLeases,
        ActionName::EndLeases,
    ];

    /// The action type string.
    pub fn as_str(self) -> &'static str {
        match self {
            ActionName::Lookup => "lookup",
            ActionName::Delete => "delete",
            ActionName::DeleteBlocks => "delete_blocks",
            ActionName::Enumerate => "enumerate",
            ActionName::CreateBucket => "create_bucket",
            ActionName::DeleteBucket => "delete_bucket",
            ActionName::DeletePrefix => "delete_prefix",
            ActionName::DeleteJob => "delete_job",
            ActionName::SetEpoch => "set_epoch",
            ActionName::Stats => "stats",
            ActionName::Drain => "drain",
            ActionName::SetCores => "set_cores",
            ActionName::Wait => "wait",
            ActionName::Subscribe => "subscribe",
            ActionName::Events => "events",
            ActionName::Unsubscribe => "unsubscribe",
            ActionName::RenewLeases => "renew_leases",
            ActionName::EndLeases => "end_leases",
        }
    }

    /// The action with type string `name`.
    pub fn from_name(name: &str) -> Result<Self, ProtocolError> {
        ActionName::ALL
            .into_iter()
            .find(|action| action.as_str() == name)
            .ok_or_else(|| ProtocolError::UnknownAction(name.chars().take(64).collect()))
    }

    /// Whether only the admin token may call the action.
    pub fn admin_only(self) -> bool {
        matches!(
            self,
            ActionName::SetEpoch | ActionName::Stats | ActionName::Drain | ActionName::SetCores
        )
    }

    /// Whether the action stores new data (refused while draining).
    pub fn is_write(self) -> bool {
        matches!(self, ActionName::CreateBucket)
    }

    /// One-line description for ListActions.
    pub fn description(self) -> &'static str {
        match self {
            ActionName::Lookup => "header of one object: {bucket, key}",
            ActionName::Delete => {
                "remove one object, returning its header: {bucket, key, version?}"
            }
            ActionName::DeleteBlocks => {
                "free data blocks of one version: {bucket, key, version, blocks}"
            }
            ActionName::Enumerate => "list keys by prefix: {bucket, prefix, start_after?, limit}",
            ActionName::CreateBucket => "create a bucket on this server: {bucket}",
            ActionName::DeleteBucket => "remove a bucket and all its records: {bucket}",
            ActionName::DeletePrefix => {
                "remove every record of a bucket under a prefix: {bucket, prefix}"
            }
            ActionName::DeleteJob => {
                "remove every non-PERSIST record of a job (with persist, every record): {job?, persist?}"
            }
            ActionName::SetEpoch => "admin: set a job's weight-map epoch: {job, epoch, map}",
            ActionName::Stats => "admin: server statistics",
            ActionName::Drain => {
                "admin: refuse writes, optionally exit once empty: {exit_when_empty}"
            }
            ActionName::SetCores => "admin: run the server on this many CPU cores: {cores}",
            ActionName::Wait => {
                "park until every key exists or the deadline passes: {bucket, keys, timeout_ms}"
            }
            ActionName::Subscribe => {
                "subscribe to ops on a bucket prefix: {bucket, prefix, ops, capacity?}"
            }
            ActionName::Events => {
                "next events of a subscription, parked until one comes: {subscription, timeout_ms, max?}"
            }
            ActionName::Unsubscribe => "end a subscription: {subscription}",
            ActionName::RenewLeases => "renew or start prefix leases: {prefixes, lease_ms}",
            ActionName::EndLeases => "end prefix leases now, freeing their prefixes: {prefixes}",
        }
    }
}

/// Any action body, parsed only for its `ctx` (to authorize before the full parse).
#[derive(Clone, Debug, Deserialize)]
pub struct AnyRequest {
    /// Who is asking.
    pub ctx: Context,
}

/// `lookup` and `delete`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectRequest {
    /// Who is asking.
    pub ctx: Context,
    /// Bucket.
    pub bucket: String,
    /// Key.
    pub key: String,
    /// `delete` only: remove the record only if it is this version (`not_found` otherwise), so a
    /// writer can withdraw its own put without touching one that replaced it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
}

/// `delete_blocks`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteBlocksRequest {
    /// Who is asking.
    pub ctx: Context,
    /// Bucket.
    pub bucket: String,
    /// Key.
    pub key: String,
    /// Version whose blocks are freed.
    pub version: u64,
    /// Block indices (>= 1).
    pub blocks: Vec<u32>,
}

/// `enumerate`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnumerateRequest {
    /// Who is asking.
    pub ctx: Context,
    /// Bucket.
    pub bucket: String,
    /// Key prefix; empty lists everything.
    #[serde(default)]
    pub prefix: String,
    /// List keys strictly after this one.
    #[serde(default)]
    pub start_after: Option<String>,
    /// Most keys to return, 1..=`ENUMERATE_LIMIT_MAX`.
    #[serde(default = "enumerate_limit_default")]
    pub limit: u32,
}

fn enumerate_limit_default() -> u32 {
    ENUMERATE_LIMIT_MAX
}

/// `create_bucket` and `delete_bucket`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketRequest {
    /// Who is asking.
    pub ctx: Context,
    /// Bucket.
    pub bucket: String,
}

/// `delete_prefix`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixRequest {
    /// Who is asking.
    pub ctx: Context,
    /// Bucket.
    pub bucket: String,
    /// Key prefix, required (a body without one is refused rather than taken as "everything");
    /// an explicit empty prefix removes every record of the bucket.
    pub prefix: String,
}

/// `delete_job`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteJobRequest {
    /// Who is asking.
    pub ctx: Context,
    /// Whose data (admin only); defaults to the ctx job.
    #[serde(default)]
    pub job: Option<String>,
    /// Also delete the job's PERSIST data (admin only): the operator removing what an ended job
    /// left (`pocketflow persist rm`).
    #[serde(default)]
    pub persist: bool,
}

/// `set_epoch`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SetEpochRequest {
    /// The admin.
    pub ctx: Context,
    /// Job whose epoch is set.
    pub job: String,
    /// The job's current epoch.
    pub epoch: u64,
    /// The job's weight map, returned verbatim in `stale_epoch` errors.
    #[serde(default)]
    pub map: serde_json::Value,
}

/// `drain`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainRequest {
    /// The admin.
    pub ctx: Context,
    /// Exit with status 0 once the server holds no records.
    #[serde(default)]
    pub exit_when_empty: bool,
}

/// `wait`: the keys a reader needs, and how long the server may park the call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitRequest {
    /// Who is asking.
    pub ctx: Context,
    /// Bucket.
    pub bucket: String,
    /// Keys awaited, 1..=`WAIT_KEYS_MAX`.
    pub keys: Vec<String>,
    /// Longest the call is parked, 0..=`WAIT_TIMEOUT_MAX_MS` (0 only checks).
    pub timeout_ms: u64,
}

/// `subscribe`: which operations on which keys, and how many events to keep.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubscribeRequest {
    /// Who is asking.
    pub ctx: Context,
    /// Bucket.
    pub bucket: String,
    /// Key prefix; empty: every key.
    #[serde(default)]
    pub prefix: String,
    /// Operations: `put`, `delete`, `enqueue`, `dequeue`, `lease_expired` (1..=5 of them).
    pub ops: Vec<String>,
    /// Events kept before the oldest is lost, 1..=`SUBSCRIBER_EVENTS_MAX` (default 4096).
    #[serde(default = "subscriber_events_default")]
    pub capacity: usize,
}

fn subscriber_events_default() -> usize {
    4096
}

impl SubscribeRequest {
    /// Parse and validate.
    pub fn parse(body: &[u8]) -> Result<Self, ProtocolError> {
        let req: Self = parse_json("action body", body)?;
        check_bucket(&req.bucket)?;
        check_prefix(&req.prefix)?;
        if req.ops.is_empty() || req.ops.len() > 5 {
            return Err(ProtocolError::Field {
                what: "ops",
                why: "must name 1..=5 operations",
            });
        }
        if req.capacity == 0 || req.capacity > SUBSCRIBER_EVENTS_MAX {
            return Err(ProtocolError::Field {
                what: "capacity",
                why: "must be in 1..=SUBSCRIBER_EVENTS_MAX",
            });
        }
        Ok(req)
    }
}

/// Result of `subscribe`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubscribeResult {
    /// The subscription's id on this server.
    pub subscription: u64,
}

/// `events` and `unsubscribe`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventsRequest {
    /// Who is asking.
    pub ctx: Context,
    /// The subscription.
    pub subscription: u64,
    /// `events`: longest the call is parked, 0..=`WAIT_TIMEOUT_MAX_MS`.
    #[serde(default)]
    pub timeout_ms: u64,
    /// `events`: most events returned, 1..=`EVENTS_BATCH_MAX` (default and most).
    #[serde(default = "events_batch_default")]
    pub max: usize,
    /// `events`: keep the events returned until a later call confirms them with `acked`
    /// (default false: they leave the subscription with the reply).
    #[serde(default)]
    pub keep: bool,
    /// `events` with `keep`: the highest sequence number the subscriber has (absent: none yet);
    /// the subscription's events up to it leave.
    #[serde(default)]
    pub acked: Option<u64>,
}

fn events_batch_default() -> usize {
    EVENTS_BATCH_MAX
}

impl EventsRequest {
    /// Parse and validate.
    pub fn parse(body: &[u8]) -> Result<Self, ProtocolError> {
        let req: Self = parse_json("action body", body)?;
        if req.timeout_ms > WAIT_TIMEOUT_MAX_MS {
            return Err(ProtocolError::Field {
                what: "timeout_ms",
                why: "must be at most WAIT_TIMEOUT_MAX_MS",
            });
        }
        if req.max == 0 || req.max > EVENTS_BATCH_MAX {
            return Err(ProtocolError::Field {
                what: "max",
                why: "must be in 1..=EVENTS_BATCH_MAX",
            });
        }
        Ok(req)
    }
}

/// One event of an `events` result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventJson {
    /// The server's sequence number of the event.
    pub seq: u64,
    /// The operation's name.
    pub op: String,
    /// Bucket (empty for `lease_expired`).
    pub bucket: String,
    /// Key, queue name or lease prefix.
    pub key: String,
}

/// Result of `events`: the events, oldest first, and how many were lost before them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventsResult {
    /// Events in this server's order.
    pub events: Vec<EventJson>,
    /// Events lost (the subscription's oldest, when it was full) since the previous call.
    pub dropped: u64,
}

/// `renew_leases`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenewLeasesRequest {
    /// Who is asking.
    pub ctx: Context,
    /// Prefixes whose leases are renewed (1..=`LEASE_PREFIXES_MAX`, each a non-empty key
    /// prefix without the trailing `/`).
    pub prefixes: Vec<String>,
    /// Lease length, `LEASE_MS_MIN..=LEASE_MS_MAX`.
    pub lease_ms: u64,
}

impl RenewLeasesRequest {
    /// Parse and validate.
    pub fn parse(body: &[u8]) -> Result<Self, ProtocolError> {
        let req: Self = parse_json("action body", body)?;
        check_lease_prefixes(&req.prefixes)?;
        if !(LEASE_MS_MIN..=LEASE_MS_MAX).contains(&req.lease_ms) {
            return Err(ProtocolError::Field {
                what: "lease_ms",
                why: "must be in LEASE_MS_MIN..=LEASE_MS_MAX",
            });
        }
        Ok(req)
    }
}

/// Result of `renew_leases`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenewLeasesResult {
    /// Leases the job holds on this server after the renewal.
    pub leases: usize,
}

/// `end_leases`: the job is done with these prefixes (their data was consumed).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndLeasesRequest {
    /// Who is asking.
    pub ctx: Context,
    /// Prefixes whose leases end now (1..=`LEASE_PREFIXES_MAX`, each a non-empty key prefix
    /// without the trailing `/`).
    pub prefixes: Vec<String>,
}

impl EndLeasesRequest {
    /// Parse and validate.
    pub fn parse(body: &[u8]) -> Result<Self, ProtocolError> {
        let req: Self = parse_json("action body", body)?;
        check_lease_prefixes(&req.prefixes)?;
        Ok(req)
    }
}

/// The prefixes of `renew_leases` and `end_leases`: 1..=`LEASE_PREFIXES_MAX` keys.
fn check_lease_prefixes(prefixes: &[String]) -> Result<(), ProtocolError> {
    if prefixes.is_empty() || prefixes.len() > LEASE_PREFIXES_MAX {
        return Err(ProtocolError::Field {
            what: "prefixes",
            why: "must hold 1..=LEASE_PREFIXES_MAX prefixes",
        });
    }
    prefixes.iter().try_for_each(|prefix| check_key(prefix))
}

/// Result of `end_leases`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndLeasesResult {
    /// How many of the named prefixes held a lease on this server (each is freed now).
    pub ended: usize,
    /// Bytes those prefixes held here, freed.
    pub freed_bytes: u64,
}

/// Result of `wait`: the awaited keys still absent when it returned (empty: all present).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitResult {
    /// Keys not present, in request order.
    pub missing: Vec<String>,
}

impl WaitRequest {
    /// Parse and validate.
    pub fn parse(body: &[u8]) -> Result<Self, ProtocolError> {
        let req: Self = parse_json("action body", body)?;
        check_bucket(&req.bucket)?;
        if req.keys.is_empty() || req.keys.len() > WAIT_KEYS_MAX {
            return Err(ProtocolError::Field {
                what: "keys",
                why: "must hold 1..=WAIT_KEYS_MAX keys",
            });
        }
        for key in &req.keys {
            check_key(key)?;
        }
        if req.timeout_ms > WAIT_TIMEOUT_MAX_MS {
            return Err(ProtocolError::Field {
                what: "timeout_ms",
                why: "must be at most WAIT_TIMEOUT_MAX_MS",
            });
        }
        Ok(req)
    }
}

impl ObjectRequest {
    /// Parse and validate.
    pub fn parse(body: &[u8]) -> Result<Self, ProtocolError> {
        let req: Self = parse_json("action body", body)?;
        check_bucket(&req.bucket)?;
        check_key(&req.key)?;
        Ok(req)
    }
}

impl DeleteBlocksRequest {
    /// Parse and validate.
    pub fn parse(body: &[u8]) -> Result<Self, ProtocolError> {
        let req: Self = parse_json("action body", body)?;
        check_bucket(&req.bucket)?;
        check_key(&req.key)?;
        if req.version == 0 {
            return Err(ProtocolError::Field {
                what: "version",
                why: "must be non-zero",
            });
        }
        if req.blocks.contains(&0) {
            return Err(ProtocolError::Field {
                what: "blocks",
                why: "block index must be >= 1",
            });
        }
        Ok(req)
    }
}

impl EnumerateRequest {
    /// Parse and validate.
    pub fn parse(body: &[u8]) -> Result<Self, ProtocolError> {
        let req: Self = parse_json("action body", body)?;
        check_bucket(&req.bucket)?;
        check_prefix(&req.prefix)?;
        if let Some(after) = &req.start_after {
            check_prefix(after)?;
        }
        if req.limit == 0 || req.limit > ENUMERATE_LIMIT_MAX {
            return Err(ProtocolError::Field {
                what: "limit",
                why: "must be in 1..=ENUMERATE_LIMIT_MAX",
            });
        }
        Ok(req)
    }
}

impl BucketRequest {
    /// Parse and validate.
    pub fn parse(body: &[u8]) -> Result<Self, ProtocolError> {
        let req: Self = parse_json("action body", body)?;
        check_bucket(&req.bucket)?;
        Ok(req)
    }
}

impl PrefixRequest {
    /// Parse and validate.
    pub fn parse(body: &[u8]) -> Result<Self, ProtocolError> {
        let req: Self = parse_json("action body", body)?;
        check_bucket(&req.bucket)?;
        check_prefix(&req.prefix)?;
        Ok(req)
    }
}

impl DeleteJobRequest {
    /// Parse and validate.
    pub fn parse(body: &[u8]) -> Result<Self, ProtocolError> {
        let req: Self = parse_json("action body", body)?;
        if let Some(job) = &req.job {
            check_job_id(job)?;
        }
        Ok(req)
    }
}

impl SetEpochRequest {
    /// Parse and validate; the map must serialize to at most `EPOCH_MAP_MAX_BYTES`.
    pub fn parse(body: &[u8]) -> Result<Self, ProtocolError> {
        let req: Self = parse_json("action body", body)?;
        check_job_id(&req.job)?;
        if req.epoch == 0 {
            return Err(ProtocolError::Field {
                what: "epoch",
                why: "must be at least 1 (epochs start at 1)",
            });
        }
        Ok(req)
    }

    /// The map as compact JSON text, checked against `EPOCH_MAP_MAX_BYTES`.
    pub fn map_json(&self) -> Result<String, ProtocolError> {
        let text = self.map.to_string();
        if text.len() > EPOCH_MAP_MAX_BYTES {
            return Err(ProtocolError::Length {
                what: "map",
                len: text.len() as u64,
                min: 0,
                max: EPOCH_MAP_MAX_BYTES as u64,
            });
        }
        Ok(text)
    }

    /// The job's reservation on server `node_id`, in bytes: the map's `reserved_bytes` object
    /// names each server's share of the job's reservation (docs/PROTOCOL.md); a map without it,
    /// or without `node_id` in it, reserves nothing there.
    pub fn reserved_bytes(&self, node_id: &str) -> Result<u64, ProtocolError> {
        let Some(shares) = self.map.get("reserved_bytes") else {
            return Ok(0);
        };
        let shares = shares.as_object().ok_or(ProtocolError::Field {
            what: "map.reserved_bytes",
            why: "must be an object of node id to bytes",
        })?;
        match shares.get(node_id) {
            None => Ok(0),
            Some(bytes) => bytes.as_u64().ok_or(ProtocolError::Field {
                what: "map.reserved_bytes",
                why: "each server's share must be a whole number of bytes",
            }),
        }
    }
}

impl DrainRequest {
    /// Parse and validate.
    pub fn parse(body: &[u8]) -> Result<Self, ProtocolError> {
        parse_json("action body", body)
    }
}

/// `set_cores`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetCoresRequest {
    /// The admin.
    pub ctx: Context,
    /// CPU cores the server may run on from now on (1..=`cores_max` of its statistics).
    pub cores: u32,
}

impl SetCoresRequest {
    /// Parse and validate (the upper bound is the server's and is checked by it).
    pub fn parse(body: &[u8]) -> Result<Self, ProtocolError> {
        let req: Self = parse_json("action body", body)?;
        if req.cores == 0 {
            return Err(ProtocolError::Field {
                what: "cores",
                why: "must be at least 1",
            });
        }
        Ok(req)
    }
}

/// `set_cores` result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetCoresResult {
    /// CPU cores the server runs on now.
    pub cores: u32,
    /// CPU cores it may be given at most (those it was allowed when it started).
    pub cores_max: u32,
}

/// An object header as JSON (`lookup` and `delete` results).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeaderJson {
    /// Version of the put.
    pub version: u64,
    /// Object size in bytes.
    pub size: u64,
    /// Data blocks (0 for a small object).
    pub block_count: u32,
    /// Bytes per data block (0 for a small object).
    pub block_size: u32,
    /// Whether the object is PERSIST.
    pub persist: bool,
}

impl From<ObjectHeader> for HeaderJson {
    fn from(h: ObjectHeader) -> Self {
        Self {
            version: h.version,
            size: h.size,
            block_count: h.block_count,
            block_size: h.block_size,
            persist: h.persist(),
        }
    }
}

impl From<HeaderJson> for ObjectHeader {
    fn from(h: HeaderJson) -> Self {
        Self {
            version: h.version,
            size: h.size,
            block_count: h.block_count,
            block_size: h.block_size,
            flags: if h.persist { HEADER_FLAG_PERSIST } else { 0 },
        }
    }
}

/// `{"freed_bytes": n}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreedResult {
    /// Bytes returned to the tier.
    pub freed_bytes: u64,
}

/// `{"deleted": n, "freed_bytes": n}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeletedResult {
    /// Records removed.
    pub deleted: u64,
    /// Bytes returned to the tier.
    pub freed_bytes: u64,
}

/// One key of an `enumerate` result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyEntry {
    /// The key.
    pub key: String,
    /// The object's size in bytes.
    pub size: u64,
}

/// `enumerate` result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnumerateResult {
    /// Keys in ascending order.
    pub keys: Vec<KeyEntry>,
    /// Whether more keys follow the last one.
    pub truncated: bool,
}

/// `drain` result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainResult {
    /// Always true.
    pub draining: bool,
}

/// Usage of one job in a statistics sample.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobUsageJson {
    /// Bytes held for the job.
    pub used_bytes: u64,
    /// Records held for the job.
    pub objects: u64,
    /// Channel entries held for the job: queue and append-file segments, queue items and append
    /// records.
    #[serde(default)]
    pub channel_entries: u64,
    /// The job's share of its reservation on the server (`set_epoch`'s `reserved_bytes`; 0:
    /// none).
    #[serde(default)]
    pub reserved_bytes: u64,
    /// The job's writes refused here for want of room, by the limit they hit, since the server
    /// first held a bucket or a share of the job (forgotten with the job).
    #[serde(default)]
    pub capacity_refusals: CapacityRefusals,
}

/// Writes refused with `capacity_exhausted`, by the limit they hit (the `limit` label of the
/// metric `pocketflow_capacity_refusals_total`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CapacityRefusals {
    /// The tier's room for data was full (capacity less the records' reserve).
    pub data: u64,
    /// The whole tier was full, the records' reserve too (a manifest refused).
    pub records: u64,
    /// The free room was held for other jobs' reservation shares.
    pub reserved: u64,
    /// The bytes were free, but not in one extent of the write's size (fragmented free space).
    pub extent: u64,
    /// The room was held by deleted blocks whose writes to the device did not complete in
    /// time (NVMe write-behind).
    pub freeing: u64,
}

/// `stats` result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatsReport {
    /// The server's `--node-id`.
    pub node_id: String,
    /// `"dram"` or `"nvme"`.
    pub tier: String,
    /// Whether the server accepts PERSIST.
    pub long_running: bool,
    /// Whether the server refuses writes.
    pub draining: bool,
    /// Length of the sampled interval.
    pub interval_ms: u64,
    /// Process CPU time over wall time in the interval (1.0 = one core busy).
    pub cpu_utilization: f64,
    /// Bytes received in object values and blocks per second.
    pub bytes_in_per_s: u64,
    /// Bytes sent in object values and blocks per second.
    pub bytes_out_per_s: u64,
    /// Operations (exchange ops, DoPut/DoGet streams, actions) per second.
    pub ops_per_s: u64,
    /// Bytes per second the server can move: the larger of its start-up self-test (the slower of
    /// writing and reading back a test block through its engine, capped by the link speed of a
    /// non-loopback interface it serves on) and the busiest sampled `bytes_in_per_s + bytes_out_per_s` since
    /// it started. 0 when it has neither.
    #[serde(default)]
    pub throughput_bytes_per_s: u64,
    /// Capacity of the tier.
    pub capacity_bytes: u64,
    /// Bytes in use.
    pub used_bytes: u64,
    /// Records held.
    pub objects: u64,
    /// Channel entries held (queue and append-file segments, queue items, append records); their
    /// bytes are in `used_bytes`.
    #[serde(default)]
    pub channel_entries: u64,
    /// Of the tier's bytes, those of deleted blocks still held by their writes to the device
    /// (NVMe write-behind): free once the device completes them, and a write that needs them
    /// waits for them. Not in `used_bytes`, which counts what the index holds.
    #[serde(default)]
    pub freeing_bytes: u64,
    /// Writes refused with `capacity_exhausted` since the server started, by the limit they hit.
    #[serde(default)]
    pub capacity_refusals: CapacityRefusals,
    /// Usage per job: every job with a bucket or a reservation share on the server.
    pub jobs: BTreeMap<String, JobUsageJson>,
    /// CPU cores the server runs on now (see `set_cores`).
    pub cores: u32,
    /// CPU cores it may be given at most.
    pub cores_max: u32,
    /// Runtime worker threads (fixed at start, `--threads`).
    pub threads: u32,
    /// Time-to-live of PERSIST objects in milliseconds; 0 when they never expire.
    pub persist_ttl_ms: u64,
    /// Queue ops (dequeues of an empty segment, enqueues into a full one) parked now.
    #[serde(default)]
    pub parked_queue_ops: u64,
    /// Requests served since start, the sum of the metrics' `pocketflow_requests_total`.
    #[serde(default)]
    pub requests_total: u64,
    /// Value bytes received since start (`pocketflow_received_bytes_total`).
    #[serde(default)]
    pub received_bytes_total: u64,
    /// Value bytes sent since start (`pocketflow_sent_bytes_total`).
    #[serde(default)]
    pub sent_bytes_total: u64,
    /// The pin table of a shared DRAM arena (zero-copy reads); absent on other servers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pins: Option<PinStats>,
}

/// The pin table of a server whose DRAM arena is shared (`stats`'s `pins`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinStats {
    /// Pins held now.
    pub pins: u64,
    /// Bytes they hold.
    pub pinned_bytes: u64,
    /// Pins granted since start.
    pub granted_total: u64,
    /// Pins refused at a bound since start (the readers copied instead).
    pub refused_total: u64,
    /// Pins released by the sweep because their process was gone, since start.
    pub swept_total: u64,
    /// The bounds: bytes over all jobs, bytes per job, pins per process.
    pub pinned_bytes_max: u64,
    /// See `pinned_bytes_max`.
    pub job_pinned_bytes_max: u64,
    /// See `pinned_bytes_max`.
    pub process_pins_max: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTX: &str = r#""ctx":{"job":"j","epoch":1,"token":"t"}"#;

    #[test]
    fn names_round_trip() {
        for action in ActionName::ALL {
            assert_eq!(ActionName::from_name(action.as_str()).unwrap(), action);
            assert!(!action.description().is_empty());
        }
        assert!(matches!(
            ActionName::from_name("reboot"),
            Err(ProtocolError::UnknownAction(_))
        ));
        assert!(ActionName::Stats.admin_only() && !ActionName::DeleteJob.admin_only());
    }

    #[test]
    fn bodies_parse_and_validate() {
        let req = ObjectRequest::parse(format!(r#"{{{CTX},"bucket":"b","key":"k"}}"#).as_bytes())
            .unwrap();
        assert_eq!(req.key, "k");
        assert!(ObjectRequest::parse(format!(r#"{{{CTX},"bucket":"b"}}"#).as_bytes()).is_err());
        assert!(ObjectRequest::parse(br#"{"bucket":"b","key":"k"}"#).is_err());

        let body = format!(r#"{{{CTX},"bucket":"b","key":"k","version":2,"blocks":[1,2]}}"#);
        assert_eq!(
            DeleteBlocksRequest::parse(body.as_bytes()).unwrap().blocks,
            vec![1, 2]
        );
        let body = format!(r#"{{{CTX},"bucket":"b","key":"k","version":2,"blocks":[0]}}"#);
        assert!(DeleteBlocksRequest::parse(body.as_bytes()).is_err());

        let req =
            EnumerateRequest::parse(format!(r#"{{{CTX},"bucket":"b","prefix":"p/"}}"#).as_bytes())
                .unwrap();
        assert_eq!((req.limit, req.start_after), (ENUMERATE_LIMIT_MAX, None));
        for limit in [0, ENUMERATE_LIMIT_MAX + 1] {
            let body = format!(r#"{{{CTX},"bucket":"b","limit":{limit}}}"#);
            assert!(EnumerateRequest::parse(body.as_bytes()).is_err());
        }

        let req = SetEpochRequest::parse(
            format!(r#"{{{CTX},"job":"x","epoch":4,"map":{{"a":1}}}}"#).as_bytes(),
        )
        .unwrap();
        assert_eq!(req.map_json().unwrap(), r#"{"a":1}"#);
        assert_eq!(req.reserved_bytes("dram-0").unwrap(), 0);
        let shares = |map: &str| {
            SetEpochRequest::parse(
                format!(r#"{{{CTX},"job":"x","epoch":4,"map":{map}}}"#).as_bytes(),
            )
            .unwrap()
        };
        let req = shares(r#"{"reserved_bytes":{"dram-0":4096,"nvme-0":0}}"#);
        assert_eq!(req.reserved_bytes("dram-0").unwrap(), 4096);
        assert_eq!(req.reserved_bytes("nvme-0").unwrap(), 0);
        assert_eq!(req.reserved_bytes("dram-1").unwrap(), 0);
        assert!(shares(r#"{"reserved_bytes":[1]}"#)
            .reserved_bytes("dram-0")
            .is_err());
        assert!(shares(r#"{"reserved_bytes":{"dram-0":-1}}"#)
            .reserved_bytes("dram-0")
            .is_err());
        assert!(shares(r#"{"reserved_bytes":{"dram-0":1.5}}"#)
            .reserved_bytes("dram-0")
            .is_err());
        let huge = format!(
            r#"{{{CTX},"job":"x","epoch":4,"map":"{}"}}"#,
            "m".repeat(EPOCH_MAP_MAX_BYTES)
        );
        assert!(SetEpochRequest::parse(huge.as_bytes())
            .unwrap()
            .map_json()
            .is_err());

        assert!(
            !DrainRequest::parse(format!("{{{CTX}}}").as_bytes())
                .unwrap()
                .exit_when_empty
        );
        assert_eq!(
            DeleteJobRequest::parse(format!("{{{CTX}}}").as_bytes())
                .unwrap()
                .job,
            None
        );
        assert!(DeleteJobRequest::parse(format!(r#"{{{CTX},"job":""}}"#).as_bytes()).is_err());

        let req = WaitRequest::parse(
            format!(r#"{{{CTX},"bucket":"b","keys":["a","b"],"timeout_ms":5}}"#).as_bytes(),
        )
        .unwrap();
        assert_eq!((req.keys.len(), req.timeout_ms), (2, 5));
        let too_long = WAIT_TIMEOUT_MAX_MS + 1;
        for bad in [
            r#""keys":[],"timeout_ms":5"#.to_owned(),
            format!(r#""keys":["a"],"timeout_ms":{too_long}"#),
            r#""keys":[""],"timeout_ms":5"#.to_owned(),
            r#""keys":["a"]"#.to_owned(),
        ] {
            let body = format!(r#"{{{CTX},"bucket":"b",{bad}}}"#);
            assert!(WaitRequest::parse(body.as_bytes()).is_err(), "{bad}");
        }
        let many: Vec<String> = (0..=WAIT_KEYS_MAX).map(|i| format!("\"k{i}\"")).collect();
        let body = format!(
            r#"{{{CTX},"bucket":"b","keys":[{}],"timeout_ms":1}}"#,
            many.join(",")
        );
        assert!(WaitRequest::parse(body.as_bytes()).is_err());
    }

    #[test]
    fn header_json_round_trip() {
        let h = ObjectHeader {
            version: 3,
            size: 10,
            block_count: 0,
            block_size: 0,
            flags: HEADER_FLAG_PERSIST,
        };
        let json = HeaderJson::from(h);
        assert!(json.persist);
        assert_eq!(ObjectHeader::from(json), h);
    }
}
