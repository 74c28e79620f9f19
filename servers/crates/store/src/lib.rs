//! pocketflow's storage layer: engines for each tier, the per-server object index, capacity
//! accounting and the object semantics of docs/PROTOCOL.md. No networking lives here; the Flight
//! service calls [`Store`].
//!
//! # Layers
//!
//! - [`engine`]: one tier of bytes behind the [`Engine`] trait. [`engine::dram::DramEngine`]
//!   keeps blocks in a prefaulted anonymous arena and reads are zero-copy;
//!   [`engine::nvme::NvmeEngine`] keeps them in a file or block device opened with O_DIRECT and
//!   driven by io_uring (the calling task submits, a task on its runtime reaps). Each owns an
//!   [`allocator::ExtentAllocator`] (best-fit with coalescing; 64-byte granularity for DRAM,
//!   4 KiB for NVMe).
//! - [`Store`]: the index (job, then bucket, then sorted maps of block-0 records and of data
//!   blocks keyed by `(key, version, index)`), write-once / overwrite, DELETE-on-read, PERSIST,
//!   prefix and job deletion, usage, and the expiry of PERSIST entries after the server's
//!   PERSIST time-to-live ([`Store::expire_persist`]).
//! - [`channels`]: FIFO queues and append files, kept in segments of a bucket beside its
//!   objects and freed with them (bucket, prefix and job deletion); [`delivery`]: a dequeued
//!   item goes back to its queue unless the reply carrying it went out.
//! - [`events`]: subscriptions to a job's operations on a prefix (notifications), and
//!   [`leases`]: prefix leases whose lapse frees the prefix.
//! - [`throughput`]: the start-up self-test of what the engine can move
//!   ([`Store::measure_throughput`]).
//!
//! # Accounting
//!
//! Every record and data block is charged its engine allocation (its length rounded up to the
//! engine granularity; nothing for an empty value) plus [`INDEX_ENTRY_OVERHEAD_BYTES`] plus its
//! key length, against a budget equal to the engine's capacity. So an empty object still costs
//! at least 65 bytes and the index cannot grow without bound. A write reserves its charge and its
//! extent before any byte is copied, and a failed write releases both. A charge is released
//! when the entry's last holder lets go: the index, or the `Bytes` of a read in progress; so
//! DELETE-on-read frees the space once the reader drops the bytes. Bucket and job counts are
//! bounded by [`BUCKETS_PER_JOB_MAX`] and [`JOBS_MAX`].
//!
//! # Concurrency
//!
//! Locks nest as job map, then a job's bucket map, then one bucket, and no lock is held across
//! an await, a copy of object bytes or I/O. Engine writers copy into their reserved extent
//! without any lock. The locks of the parked readers (`waiters`) and of the lease table
//! (`leases`) are never held together with an index lock; the subscriptions' lock (`events`) is
//! taken under a bucket lock (so a key's events keep the order of its operations) and never
//! the other way round.

#![warn(missing_docs)]

pub mod allocator;
mod capacity;
pub mod channels;
pub mod delivery;
pub mod engine;
pub mod error;
pub mod events;
mod expiry;
mod index;
pub mod leases;
pub mod pins;
mod refusals;
pub mod store;
pub mod throughput;
pub mod waiters;

pub use capacity::INDEX_ENTRY_OVERHEAD_BYTES;
pub use engine::{BlockWriter, Engine, SharedArena, StoredBlock, Tier};
pub use error::{CapacityLimit, StoreError};
pub use index::{BUCKETS_PER_JOB_MAX, JOBS_MAX};
pub use refusals::RefusalCounts;
pub use store::{BlockWrite, Claim, JobUsage, PinRead, Store, StoreConfig, Usage};
pub use throughput::Throughput;
