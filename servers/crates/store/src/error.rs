//! The store's one error enum, and its mapping to the protocol's error kinds.

use std::io;
use std::path::{Path, PathBuf};

use pocketflow_protocol::header::HeaderError;

/// Every way a store or engine operation can fail.
///
/// Operating errors (bad input, full tier, failed I/O) are values of this enum; programmer errors
/// are assertions. [`StoreError::kind`] maps each variant to the error kind of docs/PROTOCOL.md.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No block-0 record with this key.
    #[error("no object '{key}' in bucket '{bucket}'")]
    NotFound {
        /// Bucket that was searched.
        bucket: String,
        /// Key that is missing.
        key: String,
    },
    /// No data block with this address.
    #[error("no data block {index} of version {version} of '{key}'")]
    BlockNotFound {
        /// Object key.
        key: String,
        /// Writer-chosen version of the object.
        version: u64,
        /// 1-based block index.
        index: u32,
    },
    /// A PIN of an object this server cannot hand out in place (the reader copies it instead).
    #[error("not pinnable: {why}")]
    NotPinnable {
        /// Why not.
        why: &'static str,
    },
    /// A PIN over one of the pin table's bounds (the reader copies the object instead).
    #[error("pin refused: {what} at its bound of {max}")]
    PinBound {
        /// The bound (`server pinned bytes`, `job pinned bytes`, `pins of the process`).
        what: &'static str,
        /// Its value.
        max: u64,
    },
    /// The bucket does not exist on this server.
    #[error("no bucket '{bucket}'")]
    BucketNotFound {
        /// Bucket that is missing.
        bucket: String,
    },
    /// Write-once: the key already holds an object and OVERWRITE was not set.
    #[error("object '{key}' already exists in bucket '{bucket}'")]
    AlreadyExists {
        /// Bucket of the object.
        bucket: String,
        /// Key of the object.
        key: String,
    },
    /// The data block was already written (versions are unique per put, so this is a client bug).
    #[error("data block {index} of version {version} of '{key}' already exists")]
    BlockExists {
        /// Object key.
        key: String,
        /// Object version.
        version: u64,
        /// 1-based block index.
        index: u32,
    },
    /// `create_bucket` of a bucket that exists.
    #[error("bucket '{bucket}' already exists")]
    BucketExists {
        /// Bucket that exists.
        bucket: String,
    },
    /// The tier cannot hold `requested` more bytes; nothing of the failed write is left behind.
    /// `limit` says which bound was hit, and the message gives the figures of that bound.
    #[error("{}", describe_full(*requested, *available, limit))]
    CapacityExhausted {
        /// Bytes the operation needed (including accounting overhead).
        requested: u64,
        /// Bytes still free under the bound that was hit.
        available: u64,
        /// Which bound.
        limit: CapacityLimit,
    },
    /// A server-wide table (prefix leases, subscriptions' events) is at its bound.
    #[error("{table} is full: {requested} more requested, {available} of {max} free")]
    TableFull {
        /// What the table holds.
        table: &'static str,
        /// Entries the operation needed.
        requested: u64,
        /// Entries still free.
        available: u64,
        /// The table's bound.
        max: u64,
    },
    /// A job already has the maximum number of buckets on this server.
    #[error("job has the maximum of {max} buckets on this server")]
    TooManyBuckets {
        /// The bound, `BUCKETS_PER_JOB_MAX`.
        max: usize,
    },
    /// The server already holds the maximum number of jobs.
    #[error("server holds the maximum of {max} jobs")]
    TooManyJobs {
        /// The bound, `JOBS_MAX`.
        max: usize,
    },
    /// The object header is malformed.
    #[error("bad object header: {0}")]
    BadHeader(#[from] HeaderError),
    /// A block-0 value does not match its header (small object: `size`; manifest: empty).
    #[error("value of {actual} bytes does not match the header, which needs {expected}")]
    ValueLengthMismatch {
        /// Length the header implies.
        expected: u64,
        /// Length that was sent.
        actual: u64,
    },
    /// A job id, bucket or key is empty or longer than its protocol bound.
    #[error("{what} of {len} bytes is not within 1..={max} bytes")]
    InvalidName {
        /// Which name: "job", "bucket" or "key".
        what: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The protocol bound.
        max: usize,
    },
    /// A data block address uses version 0 or index 0, which are reserved.
    #[error("data block address needs a non-zero version and index, got version {version} index {index}")]
    InvalidBlockAddress {
        /// Version given.
        version: u64,
        /// Index given.
        index: u32,
    },
    /// A data block of zero bytes (every data block holds at least one byte).
    #[error("data block length must be non-zero")]
    EmptyBlock,
    /// A data block larger than `BLOCK_SIZE_MAX_BYTES`.
    #[error("data block of {len} bytes exceeds the maximum of {max}")]
    BlockTooLarge {
        /// Declared length.
        len: u64,
        /// The bound.
        max: u64,
    },
    /// The bytes appended to a block do not add up to its declared length.
    #[error("block declared {expected} bytes but {actual} were written")]
    LengthMismatch {
        /// Declared length.
        expected: u64,
        /// Bytes appended so far (or that would be, for an overlong append).
        actual: u64,
    },
    /// A read range extends past the end of the block.
    #[error("range offset {offset} length {len} is outside the block of {block_len} bytes")]
    InvalidRange {
        /// Offset in the block.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Length of the block.
        block_len: u64,
    },
    /// An enumerate limit outside `1..=ENUMERATE_LIMIT_MAX`.
    #[error("enumerate limit {limit} is not within 1..={max}")]
    InvalidLimit {
        /// Limit given.
        limit: u32,
        /// The bound.
        max: u32,
    },
    /// A PERSIST write on a server that is not long-running.
    #[error("this server is not long-running and refuses PERSIST objects")]
    PersistRefused,
    /// The NVMe tier was configured without a file or device path.
    #[error("the nvme tier needs a file or block device path")]
    NvmePathRequired,
    /// The configured capacity is below what the engine can use.
    #[error("capacity of {capacity_bytes} bytes is below the minimum of {min_bytes}")]
    CapacityTooSmall {
        /// Capacity given.
        capacity_bytes: u64,
        /// Smallest usable capacity.
        min_bytes: u64,
    },
    /// The configured capacity is larger than the block device.
    #[error("capacity of {capacity_bytes} bytes exceeds the {device_bytes} bytes of {}", .path.display())]
    CapacityExceedsDevice {
        /// Device path.
        path: PathBuf,
        /// Capacity given.
        capacity_bytes: u64,
        /// Size of the device.
        device_bytes: u64,
    },
    /// The file system of the NVMe path refuses O_DIRECT (e.g. tmpfs on older kernels).
    #[error("{} does not support O_DIRECT; put the nvme path on a file system that does (ext4, xfs) or a block device", .path.display())]
    DirectIoUnsupported {
        /// The path that was opened.
        path: PathBuf,
    },
    /// An operating-system call failed.
    #[error("{op}{}: {source}", path_suffix(.path))]
    Io {
        /// The operation, e.g. "open", "fallocate", "io_uring read".
        op: &'static str,
        /// The file involved, if any.
        path: Option<PathBuf>,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A block's bytes were accepted (its put returned) but a write behind the put failed, so
    /// they are not on the device: the block cannot be read, ever. Its writer (or the lineage
    /// that made it) must write it again.
    #[error("the block's bytes were accepted but never reached {}: {cause}", .path.display())]
    DataLost {
        /// The engine's file or device.
        path: PathBuf,
        /// The first failure of the block's writes.
        cause: String,
    },
    /// The engine's I/O ring has stopped (the engine is shutting down or crashed).
    #[error("the storage engine's I/O ring has stopped")]
    EngineStopped,
    /// A queue segment held its `max_items` for the whole wait of an enqueue.
    #[error("queue '{name}' segment {segment} holds its maximum of {max_items} items")]
    QueueFull {
        /// Queue name.
        name: String,
        /// Segment index.
        segment: u32,
        /// The segment's bound.
        max_items: u32,
    },
    /// A queue or append-file segment is sealed; writers go on in the next segment.
    #[error("segment {segment} of '{name}' is sealed")]
    Sealed {
        /// Queue or append-file name.
        name: String,
        /// Segment index.
        segment: u32,
    },
    /// A lease renewal named new prefixes past the job's share of the lease table or past the
    /// table's bound: those were refused; every lease the job already held was renewed.
    #[error(
        "{refused} new prefix lease(s) refused (the first: '{first}'): {why}; the {held} leases \
         job '{job}' holds here were renewed"
    )]
    LeaseTableFull {
        /// The job.
        job: String,
        /// New prefixes refused.
        refused: usize,
        /// The first prefix refused.
        first: String,
        /// Leases the job holds here after the renewal.
        held: usize,
        /// Which bound: the job's share or the table's.
        why: String,
    },
    /// A queue or append-file argument is outside its bound.
    #[error("{what} {value} is not within {min}..={max}")]
    InvalidChannelArgument {
        /// Which argument.
        what: &'static str,
        /// Value given.
        value: u64,
        /// Smallest allowed.
        min: u64,
        /// Largest allowed.
        max: u64,
    },
}

fn path_suffix(path: &Option<PathBuf>) -> String {
    match path {
        Some(path) => format!(" {}", path.display()),
        None => String::new(),
    }
}

/// Which bound of a tier a write hit (see [`StoreError::CapacityExhausted`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapacityLimit {
    /// The tier's room for data: its capacity less the reserve that only records without data
    /// (manifests, which name where an object's blocks went) may use.
    Data {
        /// The tier's capacity.
        capacity_bytes: u64,
        /// The part of it kept for records.
        reserve_bytes: u64,
    },
    /// The tier's whole capacity, the records' reserve included.
    Records {
        /// The tier's capacity.
        capacity_bytes: u64,
    },
    /// The tier has the bytes free, but they are held for other jobs' reservations here (each
    /// job's reserved bytes it has not used), and the write is beyond the writing job's own
    /// reservation (docs/ARCHITECTURE.md, "Bigger than DRAM").
    Reserved {
        /// The tier's capacity.
        capacity_bytes: u64,
        /// The part of it kept for records (0 for a record, which may use it).
        reserve_bytes: u64,
        /// The other jobs' unused reservations together.
        reserved_for_others_bytes: u64,
        /// What the writing job holds here.
        job_used_bytes: u64,
        /// The writing job's reservation here (0: none).
        job_reserved_bytes: u64,
    },
    /// The engine has the bytes free, but not in one extent: the largest free extent is this
    /// big (its free space is fragmented).
    Extent {
        /// The largest free extent, in bytes.
        largest_free_bytes: u64,
    },
    /// The room is held by deleted blocks whose writes are still in the kernel (NVMe
    /// write-behind), and they did not complete within the write's wait for them.
    Freeing {
        /// Bytes of deleted blocks still held by their writes.
        freeing_bytes: u64,
        /// The largest free extent, in bytes.
        largest_free_bytes: u64,
        /// How long the write waited for them.
        waited_ms: u64,
    },
}

impl CapacityLimit {
    /// The name of each kind, as statistics and metrics label refusals (`limit`), in the order
    /// of [`CapacityLimit::index`].
    pub const NAMES: [&'static str; 5] = ["data", "records", "reserved", "extent", "freeing"];

    /// This kind's place in [`CapacityLimit::NAMES`].
    pub fn index(&self) -> usize {
        match self {
            Self::Data { .. } => 0,
            Self::Records { .. } => 1,
            Self::Reserved { .. } => 2,
            Self::Extent { .. } => 3,
            Self::Freeing { .. } => 4,
        }
    }

    /// This kind's name (`"data"`, `"records"`, `"reserved"`, `"extent"` or `"freeing"`).
    pub fn name(&self) -> &'static str {
        Self::NAMES[self.index()]
    }
}

fn describe_full(requested: u64, available: u64, limit: &CapacityLimit) -> String {
    match *limit {
        CapacityLimit::Data {
            capacity_bytes,
            reserve_bytes,
        } => format!(
            "tier is full: {requested} bytes requested, {available} bytes free for data \
             (capacity {capacity_bytes} bytes, of which {reserve_bytes} kept for records)"
        ),
        CapacityLimit::Records { capacity_bytes } => format!(
            "tier is full, its reserve for records too: {requested} bytes requested, \
             {available} bytes free (capacity {capacity_bytes} bytes)"
        ),
        CapacityLimit::Reserved {
            capacity_bytes,
            reserve_bytes,
            reserved_for_others_bytes,
            job_used_bytes,
            job_reserved_bytes,
        } => format!(
            "tier's free room is reserved for other jobs: {requested} bytes requested, \
             {available} bytes free beyond the {reserved_for_others_bytes} bytes reserved for \
             other jobs (capacity {capacity_bytes} bytes, of which {reserve_bytes} kept for \
             records); this job holds {job_used_bytes} bytes of its reservation of \
             {job_reserved_bytes} bytes here"
        ),
        CapacityLimit::Extent { largest_free_bytes } => format!(
            "tier has no free extent of {requested} bytes: {available} bytes free in pieces, \
             the largest {largest_free_bytes} bytes"
        ),
        CapacityLimit::Freeing {
            freeing_bytes,
            largest_free_bytes,
            waited_ms,
        } => format!(
            "tier has no free extent of {requested} bytes: {available} bytes free (the largest \
             extent {largest_free_bytes} bytes), and {freeing_bytes} bytes of deleted blocks are \
             still held by their writes to the device after a wait of {waited_ms} ms"
        ),
    }
}

impl StoreError {
    /// The protocol error kind of docs/PROTOCOL.md (`not_found`, `capacity_exhausted`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotFound { .. } | Self::BlockNotFound { .. } => "not_found",
            Self::BucketNotFound { .. } => "bucket_not_found",
            Self::AlreadyExists { .. } | Self::BlockExists { .. } => "already_exists",
            Self::BucketExists { .. } => "bucket_exists",
            Self::CapacityExhausted { .. }
            | Self::TableFull { .. }
            | Self::TooManyBuckets { .. }
            | Self::TooManyJobs { .. }
            | Self::PinBound { .. } => "capacity_exhausted",
            Self::BadHeader(_)
            | Self::ValueLengthMismatch { .. }
            | Self::InvalidName { .. }
            | Self::InvalidBlockAddress { .. }
            | Self::EmptyBlock
            | Self::BlockTooLarge { .. }
            | Self::LengthMismatch { .. }
            | Self::InvalidRange { .. }
            | Self::InvalidLimit { .. }
            | Self::NvmePathRequired
            | Self::CapacityTooSmall { .. }
            | Self::CapacityExceedsDevice { .. }
            | Self::DirectIoUnsupported { .. }
            | Self::InvalidChannelArgument { .. }
            | Self::NotPinnable { .. } => "invalid_argument",
            Self::QueueFull { .. } => "queue_full",
            Self::Sealed { .. } => "sealed",
            Self::LeaseTableFull { .. } => "lease_table_full",
            Self::PersistRefused => "persist_refused",
            Self::Io { .. } | Self::EngineStopped => "internal",
            Self::DataLost { .. } => "data_lost",
        }
    }

    /// An [`StoreError::Io`] about `path`.
    pub(crate) fn io(op: &'static str, path: &Path, source: io::Error) -> Self {
        Self::Io {
            op,
            path: Some(path.to_path_buf()),
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_the_protocol_table() {
        let full = StoreError::CapacityExhausted {
            requested: 10,
            available: 2,
            limit: CapacityLimit::Data {
                capacity_bytes: 100,
                reserve_bytes: 1,
            },
        };
        assert_eq!(full.kind(), "capacity_exhausted");
        assert_eq!(
            full.to_string(),
            "tier is full: 10 bytes requested, 2 bytes free for data (capacity 100 bytes, of \
             which 1 kept for records)"
        );
        let fragmented = StoreError::CapacityExhausted {
            requested: 1_048_576,
            available: 71_116_544,
            limit: CapacityLimit::Extent {
                largest_free_bytes: 524_288,
            },
        };
        assert_eq!(
            fragmented.to_string(),
            "tier has no free extent of 1048576 bytes: 71116544 bytes free in pieces, the \
             largest 524288 bytes"
        );
        let table = StoreError::TableFull {
            table: "the prefix-lease table",
            requested: 3,
            available: 1,
            max: 65_536,
        };
        assert_eq!(table.kind(), "capacity_exhausted");
        assert_eq!(StoreError::PersistRefused.kind(), "persist_refused");
        assert_eq!(
            StoreError::BadHeader(HeaderError::ZeroVersion).kind(),
            "invalid_argument"
        );
        let missing = StoreError::NotFound {
            bucket: "b".into(),
            key: "k".into(),
        };
        assert_eq!(missing.kind(), "not_found");
        assert_eq!(missing.to_string(), "no object 'k' in bucket 'b'");
        let io = StoreError::Io {
            op: "open",
            path: Some("/x".into()),
            source: io::Error::other("boom"),
        };
        assert_eq!(io.kind(), "internal");
        assert_eq!(io.to_string(), "open /x: boom");
        let lost = StoreError::DataLost {
            path: "/dev/loop0".into(),
            cause: "io_uring write: EIO".into(),
        };
        assert_eq!(lost.kind(), "data_lost");
        assert_eq!(
            lost.to_string(),
            "the block's bytes were accepted but never reached /dev/loop0: io_uring write: EIO"
        );
    }
}
