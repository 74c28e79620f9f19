//! The engine abstraction: one storage tier of one server, holding blocks of bytes at byte offsets.
//!
//! An engine reserves space up front ([`Engine::begin_write`]), takes the bytes of a block in
//! pieces of any size ([`BlockWriter::append`]) and hands back a [`StoredBlock`], a cheap handle
//! whose last clone returns the extent to the engine's allocator. Engines own alignment and
//! buffers, so the same trait fits a DRAM arena, a file or block device driven through io_uring,
//! and a userspace (SPDK) engine, whose asynchronous byte-addressed reads and writes it mirrors.
//! Engines know nothing about objects, keys or the network.

pub mod buffer;
pub mod dram;
pub mod nvme;
mod uring;
mod write_behind;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;

use bytes::Bytes;

use crate::allocator::{Extent, ExtentAllocator};
use crate::error::StoreError;
use write_behind::WriteBehind;

/// A boxed, sendable future of an engine operation (keeps the traits dyn-compatible).
pub type EngineFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// The storage tier a server (and its engine) serves.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Bytes live in a preallocated memory arena.
    #[default]
    Dram,
    /// Bytes live in a file or block device, accessed with O_DIRECT through io_uring.
    Nvme,
}

impl Tier {
    /// The protocol name of the tier: "dram" or "nvme".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Dram => "dram",
            Self::Nvme => "nvme",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A tier name that is neither "dram" nor "nvme".
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown tier '{0}', expected 'dram' or 'nvme'")]
pub struct UnknownTier(pub String);

impl FromStr for Tier {
    type Err = UnknownTier;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "dram" => Ok(Self::Dram),
            "nvme" => Ok(Self::Nvme),
            other => Err(UnknownTier(other.to_string())),
        }
    }
}

/// A DRAM arena in a memfd that readers of the same host map read-only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedArena {
    /// The memfd's descriptor in this process.
    pub fd: i32,
    /// Address of the arena's first byte in this process.
    pub base: usize,
    /// Bytes of the arena (its nonce page included).
    pub len: u64,
    /// The arena's first bytes.
    pub nonce: [u8; pocketflow_protocol::pin::ARENA_NONCE_BYTES],
}

impl SharedArena {
    /// The offset in the arena of `bytes`, if they lie wholly inside it.
    pub fn offset_of(&self, bytes: &[u8]) -> Option<u64> {
        let start = (bytes.as_ptr() as usize).checked_sub(self.base)?;
        let end = start.checked_add(bytes.len())?;
        (end as u64 <= self.len).then_some(start as u64)
    }
}

/// One storage tier: a bounded space of blocks with asynchronous writes and reads.
pub trait Engine: Send + Sync {
    /// The tier this engine implements.
    fn tier(&self) -> Tier;

    /// Usable bytes of the engine.
    fn capacity_bytes(&self) -> u64;

    /// Bytes allocated to blocks and to writes in progress.
    fn used_bytes(&self) -> u64;

    /// Of [`Engine::used_bytes`], those of deleted blocks that their writes still hold (NVMe
    /// write-behind); 0 for engines whose frees are immediate.
    fn freeing_bytes(&self) -> u64 {
        0
    }

    /// Bytes of capacity a block of `len` bytes occupies (its length rounded up to the engine's
    /// allocation granularity).
    fn allocation_bytes(&self, len: u64) -> u64;

    /// The arena that readers on this host may map, if the engine's blocks live in one (a DRAM
    /// engine opened shared).
    fn shared_arena(&self) -> Option<SharedArena> {
        None
    }

    /// Reserve space for a block of exactly `len` bytes (`len >= 1`) and return a writer for it.
    ///
    /// Fails with [`StoreError::CapacityExhausted`] when no free extent fits; dropping the writer
    /// before [`BlockWriter::finish`] frees the reservation.
    fn begin_write(&self, len: u64) -> Result<Box<dyn BlockWriter>, StoreError>;

    /// [`Engine::begin_write`], except that a write that finds no room only because deleted
    /// blocks' writes still hold it (NVMe write-behind) waits for them, bounded, instead of
    /// failing at once. Engines whose frees are immediate (the default) answer at once.
    fn begin_write_waiting(&self, len: u64) -> EngineFuture<'_, Box<dyn BlockWriter>> {
        Box::pin(async move { self.begin_write(len) })
    }

    /// Read `len` bytes at `offset` of `block`; the range must lie inside the block.
    ///
    /// The returned bytes stay valid however long they are held, even if the block is removed
    /// from the index meanwhile.
    fn read(&self, block: &StoredBlock, offset: u64, len: u64) -> EngineFuture<'static, Bytes>;
}

/// Writes one block: pieces arrive in order and must add up to the reserved length.
pub trait BlockWriter: Send {
    /// Append the next piece of the block.
    fn append(&mut self, piece: Bytes) -> EngineFuture<'_, ()>;

    /// The engine's own memory for the next `len` bytes of the block, when its blocks live in
    /// memory a caller may fill in place (the DRAM arena): the caller writes the bytes there, then
    /// counts them with [`BlockWriter::advance`], and the piece is never copied again. `None`
    /// (the default, and past the block's end) when pieces must go through
    /// [`BlockWriter::append`].
    fn spare(&mut self, len: u64) -> Option<&mut [u8]> {
        let _ = len;
        None
    }

    /// Count the `len` bytes just written into [`BlockWriter::spare`] as appended.
    ///
    /// Panics if the engine gave no spare memory of that length (a programmer error).
    fn advance(&mut self, len: u64) {
        panic!("advance by {len} bytes on an engine without in-place writes");
    }

    /// Return the block's handle once every byte is in the engine: in its memory (DRAM), or in
    /// the kernel's hands within the engine's bounded staging memory (NVMe's write-behind: the
    /// handle's reads wait for those writes); fails with [`StoreError::LengthMismatch`] if fewer
    /// bytes than reserved were appended.
    fn finish(self: Box<Self>) -> EngineFuture<'static, StoredBlock>;
}

/// A written block: its extent, length and (in debug builds) checksum.
///
/// Clones are cheap and share the extent; the last clone dropped frees it.
#[derive(Clone, Debug)]
pub struct StoredBlock {
    inner: Arc<BlockInner>,
}

#[derive(Debug)]
struct BlockInner {
    /// Shared with the block's writes still in the kernel (write-behind), so that the extent is
    /// freed only once the last of them and the last clone are gone.
    extent: Arc<Extent>,
    len: u64,
    checksum: Checksum,
    /// Writes still in the kernel when the block was handed back (NVMe write-behind).
    writes: Option<WriteBehind>,
}

impl Drop for BlockInner {
    fn drop(&mut self) {
        // Writes behind the block still hold its extent: count it as being freed, so that a
        // write that needs its room waits for them rather than fails with a tier that is full
        // only for the moment.
        if Arc::strong_count(&self.extent) > 1 {
            self.extent.mark_freeing();
        }
    }
}

impl StoredBlock {
    /// A block of `len` bytes at the start of `extent`; `checksum` covers exactly those bytes.
    pub fn new(extent: Extent, len: u64, checksum: Checksum) -> Self {
        Self::with_writes(Arc::new(extent), len, checksum, None)
    }

    /// A block whose `writes` may still be in the kernel; they hold clones of `extent`.
    pub(crate) fn with_writes(
        extent: Arc<Extent>,
        len: u64,
        checksum: Checksum,
        writes: Option<WriteBehind>,
    ) -> Self {
        assert!(
            len >= 1 && len <= extent.len(),
            "block of {len} bytes in an extent of {}",
            extent.len()
        );
        Self {
            inner: Arc::new(BlockInner {
                extent,
                len,
                checksum,
                writes,
            }),
        }
    }

    /// Wait until the block's writes are on the device (at once for a block written in full
    /// before its handle was made); `Err` says why they are not.
    pub(crate) async fn written(&self) -> Result<(), String> {
        match &self.inner.writes {
            Some(writes) => writes.wait().await,
            None => Ok(()),
        }
    }

    /// Whether the block's writes have all completed, successfully or not.
    pub fn writes_settled(&self) -> bool {
        self.inner.writes.as_ref().is_none_or(WriteBehind::settled)
    }

    /// Length of the block's data in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len
    }

    /// Whether the block holds no bytes (never true: blocks hold at least one byte).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Byte offset of the block in the engine's range.
    pub fn offset(&self) -> u64 {
        self.inner.extent.offset()
    }

    /// Bytes of capacity the block occupies.
    pub fn allocated_bytes(&self) -> u64 {
        self.inner.extent.len()
    }

    /// Checksum of the block's bytes as written.
    pub fn checksum(&self) -> Checksum {
        self.inner.checksum
    }

    /// Whether the block was allocated by `allocator` (engines assert this on read).
    pub fn belongs_to(&self, allocator: &Arc<ExtentAllocator>) -> bool {
        self.inner.extent.belongs_to(allocator)
    }

    /// Panics unless `offset..offset+len` lies inside the block (a programmer error: the store
    /// checks ranges before calling an engine).
    pub fn assert_range(&self, offset: u64, len: u64) {
        let end = offset.checked_add(len).expect("range end overflows");
        assert!(
            end <= self.len(),
            "range {offset}+{len} outside a block of {} bytes",
            self.len()
        );
    }
}

/// A running FNV-1a checksum of a block's bytes, computed only in debug builds (so release
/// builds pay nothing); blocks are checked when written and again when read whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checksum(u64);

impl Default for Checksum {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Checksum {
    /// Whether checksums are computed in this build.
    pub const ENABLED: bool = cfg!(debug_assertions);

    /// Fold `bytes` into the checksum.
    pub fn update(&mut self, bytes: &[u8]) {
        if !Self::ENABLED {
            return;
        }
        for &byte in bytes {
            self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// The checksum of `bytes` alone.
    pub fn of(bytes: &[u8]) -> Self {
        let mut checksum = Self::default();
        checksum.update(bytes);
        checksum
    }
}

/// Panics if `bytes`, read back whole from `block`, do not match what was written: the read-side
/// half of the write-side checks (length always, checksum in debug builds).
pub(crate) fn assert_read_back(block: &StoredBlock, offset: u64, len: u64, bytes: &[u8]) {
    assert_eq!(
        bytes.len() as u64,
        len,
        "engine returned {} bytes for a read of {len}",
        bytes.len()
    );
    if Checksum::ENABLED && offset == 0 && len == block.len() {
        assert_eq!(
            Checksum::of(bytes),
            block.checksum(),
            "block at {} corrupted",
            block.offset()
        );
    }
}
