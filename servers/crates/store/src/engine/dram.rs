//! The DRAM engine: blocks live in one memory arena reserved when the server starts.
//!
//! The arena is mapped once at its full capacity (optionally prefaulted, so the server owns its
//! memory from the start and the first writes do not page-fault). An [`ExtentAllocator`] with
//! 64-byte granularity hands out extents; a writer copies pieces into its extent without holding
//! any lock (extents are disjoint), and reads are zero-copy: the returned `Bytes` points into the
//! arena and keeps the block, hence its extent, alive until dropped.
//!
//! A shared arena ([`DramEngine::open_shared`]) is a sealed memfd instead of anonymous memory:
//! readers on the same host have its descriptor from the server's abstract Unix socket
//! (`SCM_RIGHTS`, peers of the server's uid only; `flight/src/pin.rs`), map it read-only and
//! read pinned blocks in place. Its first page holds a random nonce (no block lives there), by
//! which a reader knows it mapped this arena and not another server's.

use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use bytes::Bytes;

use pocketflow_protocol::pin::ARENA_NONCE_BYTES;

use super::{
    assert_read_back, BlockWriter, Checksum, Engine, EngineFuture, SharedArena, StoredBlock, Tier,
};
use crate::allocator::{Extent, ExtentAllocator};
use crate::error::StoreError;

/// Allocation granularity of the DRAM arena (one cache line).
pub const DRAM_GRANULARITY_BYTES: u64 = 64;

/// The base page size, the step of touching every page of the arena.
const PAGE_BYTES: usize = 4096;

/// The mapped arena; unmapped when the engine and every block read from it are gone.
#[derive(Debug)]
struct Arena {
    base: NonNull<u8>,
    /// Bytes mapped, the nonce page of a shared arena included.
    len: usize,
    /// Bytes before the first block: the nonce page of a shared arena, else 0.
    data_start: usize,
    /// A shared arena's memfd and nonce.
    shared: Option<(std::os::fd::OwnedFd, [u8; ARENA_NONCE_BYTES])>,
}

// SAFETY: the arena is plain memory; concurrent access is confined to disjoint extents handed out
// by the allocator (writers) or to finished blocks (readers, after the write happened-before).
unsafe impl Send for Arena {}
// SAFETY: see `Send`.
unsafe impl Sync for Arena {}

fn os_error(op: &'static str) -> StoreError {
    StoreError::Io {
        op,
        path: None,
        source: io::Error::last_os_error(),
    }
}

/// A memfd of `len` bytes that can be sealed.
fn memfd(len: usize) -> Result<std::os::fd::OwnedFd, StoreError> {
    use std::os::fd::FromRawFd;
    // SAFETY: a NUL-terminated name; the flags are valid for memfd_create.
    let fd = unsafe {
        libc::memfd_create(
            c"pocketflow-dram".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(os_error("memfd_create dram arena"));
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // SAFETY: resizing our own fresh memfd.
    if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
        return Err(os_error("ftruncate dram arena"));
    }
    Ok(owned)
}

/// A random nonce from the kernel.
fn random_nonce() -> Result<[u8; ARENA_NONCE_BYTES], StoreError> {
    let mut nonce = [0u8; ARENA_NONCE_BYTES];
    // SAFETY: writing at most `nonce.len()` bytes into `nonce`.
    let got = unsafe { libc::getrandom(nonce.as_mut_ptr().cast(), nonce.len(), 0) };
    if got != nonce.len() as isize {
        return Err(os_error("getrandom arena nonce"));
    }
    Ok(nonce)
}

impl Arena {
    fn map(len: usize, prefault: bool, shared: bool) -> Result<Self, StoreError> {
        use std::os::fd::AsRawFd;
        let data_start = if shared { PAGE_BYTES } else { 0 };
        let len = len + data_start;
        let fd = if shared { Some(memfd(len)?) } else { None };
        let (flags, raw_fd) = match &fd {
            Some(fd) => (libc::MAP_SHARED | libc::MAP_NORESERVE, fd.as_raw_fd()),
            None => (
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
            ),
        };
        // SAFETY: a fresh mapping (of no file, or of our own memfd) with no address hint touches
        // no existing memory.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                raw_fd,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(os_error("mmap dram arena"));
        }
        // Transparent huge pages cut TLB misses on large copies; failure only costs speed. The
        // advice comes before the pages exist: populated first (MAP_POPULATE), the arena was
        // built of 4 KiB pages, which khugepaged only merged minutes later, so a server fresh
        // from its start copied every block through 256 pages per MiB.
        // SAFETY: advising our own fresh mapping.
        unsafe { libc::madvise(raw, len, libc::MADV_HUGEPAGE) };
        if prefault {
            // SAFETY: populating our own fresh mapping, writable, of `len` bytes.
            let populated = unsafe { libc::madvise(raw, len, libc::MADV_POPULATE_WRITE) } == 0;
            if !populated {
                // Kernels before 5.14: touch every page instead.
                for offset in (0..len).step_by(PAGE_BYTES) {
                    // SAFETY: in bounds of the fresh mapping, which nothing else uses yet.
                    unsafe { raw.cast::<u8>().add(offset).write_volatile(0) };
                }
            }
        }
        let base = NonNull::new(raw.cast::<u8>()).expect("mmap returned null");
        let mut arena = Self {
            base,
            len,
            data_start,
            shared: None,
        };
        if let Some(fd) = fd {
            let nonce = random_nonce()?;
            // SAFETY: the nonce page lies at the start of our fresh mapping; no block uses it.
            unsafe { std::ptr::copy_nonoverlapping(nonce.as_ptr(), raw.cast(), nonce.len()) };
            // From here on no process (this one included) can map the memfd writable or change
            // its size: readers map it read-only, and the mapping above stays the only writer.
            let seals = libc::F_SEAL_FUTURE_WRITE
                | libc::F_SEAL_SHRINK
                | libc::F_SEAL_GROW
                | libc::F_SEAL_SEAL;
            // SAFETY: sealing our own memfd.
            if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
                return Err(os_error("seal dram arena"));
            }
            arena.shared = Some((fd, nonce));
        }
        Ok(arena)
    }

    /// Pointer to byte `offset` of the arena's block space.
    fn at(&self, offset: u64) -> *mut u8 {
        assert!(
            offset as usize <= self.len - self.data_start,
            "offset {offset} outside the arena"
        );
        // SAFETY: in bounds, checked above.
        unsafe { self.base.as_ptr().add(self.data_start + offset as usize) }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping created in `map`, which nothing references any more.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// Stores blocks in a preallocated memory arena.
#[derive(Debug)]
pub struct DramEngine {
    arena: Arc<Arena>,
    allocator: Arc<ExtentAllocator>,
}

impl DramEngine {
    /// Map an arena of `capacity_bytes` (rounded down to 64 bytes); with `prefault`, populate
    /// every page now.
    pub fn open(capacity_bytes: u64, prefault: bool) -> Result<Self, StoreError> {
        let capacity_bytes = capacity_bytes / DRAM_GRANULARITY_BYTES * DRAM_GRANULARITY_BYTES;
        if capacity_bytes == 0 {
            return Err(StoreError::CapacityTooSmall {
                capacity_bytes,
                min_bytes: DRAM_GRANULARITY_BYTES,
            });
        }
        Self::open_arena(capacity_bytes, prefault, false)
    }

    /// [`DramEngine::open`] with the arena in a sealed memfd that readers of the same host (and
    /// uid) can map read-only: see the module doc.
    pub fn open_shared(capacity_bytes: u64, prefault: bool) -> Result<Self, StoreError> {
        Self::open_arena(capacity_bytes, prefault, true)
    }

    fn open_arena(capacity_bytes: u64, prefault: bool, shared: bool) -> Result<Self, StoreError> {
        let capacity_bytes = capacity_bytes / DRAM_GRANULARITY_BYTES * DRAM_GRANULARITY_BYTES;
        if capacity_bytes == 0 {
            return Err(StoreError::CapacityTooSmall {
                capacity_bytes,
                min_bytes: DRAM_GRANULARITY_BYTES,
            });
        }
        let arena = Arena::map(capacity_bytes as usize, prefault, shared)?;
        Ok(Self {
            arena: Arc::new(arena),
            allocator: ExtentAllocator::new(capacity_bytes, DRAM_GRANULARITY_BYTES),
        })
    }
}

impl Engine for DramEngine {
    fn tier(&self) -> Tier {
        Tier::Dram
    }

    fn capacity_bytes(&self) -> u64 {
        self.allocator.capacity_bytes()
    }

    fn used_bytes(&self) -> u64 {
        self.allocator.used_bytes()
    }

    fn allocation_bytes(&self, len: u64) -> u64 {
        self.allocator.rounded_len(len)
    }

    fn shared_arena(&self) -> Option<SharedArena> {
        use std::os::fd::AsRawFd;
        let (fd, nonce) = self.arena.shared.as_ref()?;
        Some(SharedArena {
            fd: fd.as_raw_fd(),
            base: self.arena.base.as_ptr() as usize,
            len: self.arena.len as u64,
            nonce: *nonce,
        })
    }

    fn begin_write(&self, len: u64) -> Result<Box<dyn BlockWriter>, StoreError> {
        assert!(len >= 1, "engine blocks hold at least one byte");
        let extent = self.allocator.allocate(len)?;
        Ok(Box::new(DramWriter {
            arena: Arc::clone(&self.arena),
            extent,
            len,
            written: 0,
            checksum: Checksum::default(),
        }))
    }

    fn read(&self, block: &StoredBlock, offset: u64, len: u64) -> EngineFuture<'static, Bytes> {
        assert!(
            block.belongs_to(&self.allocator),
            "block read from another engine"
        );
        block.assert_range(offset, len);
        let view = ArenaView {
            ptr: self.arena.at(block.offset() + offset),
            len: len as usize,
            _block: block.clone(),
            _arena: Arc::clone(&self.arena),
        };
        let bytes = Bytes::from_owner(view);
        assert_read_back(block, offset, len, &bytes);
        Box::pin(std::future::ready(Ok(bytes)))
    }
}

/// Copies the pieces of one block into its extent of the arena.
struct DramWriter {
    arena: Arc<Arena>,
    extent: Extent,
    len: u64,
    written: u64,
    checksum: Checksum,
}

impl DramWriter {
    fn copy_in(&mut self, piece: &[u8]) -> Result<(), StoreError> {
        let actual = self.written + piece.len() as u64;
        if actual > self.len {
            return Err(StoreError::LengthMismatch {
                expected: self.len,
                actual,
            });
        }
        let destination = self.arena.at(self.extent.offset() + self.written);
        // SAFETY: `destination..+piece.len()` lies inside this writer's extent (checked above),
        // which no one else writes or reads until `finish`; `piece` is a separate allocation.
        unsafe { std::ptr::copy_nonoverlapping(piece.as_ptr(), destination, piece.len()) };
        self.checksum.update(piece);
        self.written = actual;
        Ok(())
    }
}

impl BlockWriter for DramWriter {
    fn append(&mut self, piece: Bytes) -> EngineFuture<'_, ()> {
        let result = self.copy_in(&piece);
        Box::pin(std::future::ready(result))
    }

    fn spare(&mut self, len: u64) -> Option<&mut [u8]> {
        if self.written + len > self.len {
            return None;
        }
        let start = self.arena.at(self.extent.offset() + self.written);
        // SAFETY: `start..+len` lies inside this writer's extent (checked above), which no one
        // else writes or reads until `finish`; the arena is mapped memory, so every byte of it is
        // initialised; the slice borrows the writer mutably, so nothing else writes it meanwhile.
        Some(unsafe { std::slice::from_raw_parts_mut(start, len as usize) })
    }

    fn advance(&mut self, len: u64) {
        let end = self.written + len;
        assert!(
            end <= self.len,
            "advance past the block: {end} > {}",
            self.len
        );
        if Checksum::ENABLED {
            let start = self.arena.at(self.extent.offset() + self.written);
            // SAFETY: inside this writer's extent (checked above), written by the caller.
            let filled = unsafe { std::slice::from_raw_parts(start, len as usize) };
            self.checksum.update(filled);
        }
        self.written = end;
    }

    fn finish(self: Box<Self>) -> EngineFuture<'static, StoredBlock> {
        let result = if self.written == self.len {
            let DramWriter {
                extent,
                len,
                checksum,
                ..
            } = *self;
            Ok(StoredBlock::new(extent, len, checksum))
        } else {
            Err(StoreError::LengthMismatch {
                expected: self.len,
                actual: self.written,
            })
        };
        Box::pin(std::future::ready(result))
    }
}

/// Owner of a zero-copy read: a slice of the arena plus what keeps it valid.
struct ArenaView {
    ptr: *const u8,
    len: usize,
    _block: StoredBlock,
    _arena: Arc<Arena>,
}

// SAFETY: the view only reads bytes of a finished block, which nobody writes while it is alive.
unsafe impl Send for ArenaView {}
// SAFETY: see `Send`.
unsafe impl Sync for ArenaView {}

impl AsRef<[u8]> for ArenaView {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the block keeps its extent allocated and the arena mapped while `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize, seed: u8) -> Bytes {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<_>>()
            .into()
    }

    async fn write(engine: &DramEngine, pieces: &[Bytes]) -> Result<StoredBlock, StoreError> {
        let len = pieces.iter().map(|p| p.len() as u64).sum();
        let mut writer = engine.begin_write(len)?;
        for piece in pieces {
            writer.append(piece.clone()).await?;
        }
        writer.finish().await
    }

    #[tokio::test]
    async fn write_read_free_round_trip() {
        let engine = DramEngine::open(1 << 20, false).unwrap();
        let data = pattern(100_000, 3);
        let block = write(
            &engine,
            &[data.slice(..1), data.slice(1..4097), data.slice(4097..)],
        )
        .await
        .unwrap();
        assert_eq!(block.len(), 100_000);
        assert_eq!(engine.used_bytes(), 100_032);
        assert_eq!(engine.read(&block, 0, 100_000).await.unwrap(), data);
        assert_eq!(
            engine.read(&block, 777, 5).await.unwrap(),
            data.slice(777..782)
        );
        drop(block);
        assert_eq!(engine.used_bytes(), 0);
    }

    #[tokio::test]
    async fn reads_outlive_the_block_handle() {
        let engine = DramEngine::open(1 << 16, true).unwrap();
        let data = pattern(1000, 9);
        let block = write(&engine, std::slice::from_ref(&data)).await.unwrap();
        let read = engine.read(&block, 0, 1000).await.unwrap();
        drop(block);
        assert_eq!(engine.used_bytes(), 1024, "the read still holds the extent");
        assert_eq!(read, data);
        drop(read);
        assert_eq!(engine.used_bytes(), 0);
    }

    #[tokio::test]
    async fn exhaustion_is_typed_and_unfinished_writers_free() {
        let engine = DramEngine::open(4096, false).unwrap();
        let writer = engine.begin_write(4000).unwrap();
        assert!(matches!(
            engine.begin_write(200),
            Err(StoreError::CapacityExhausted {
                requested: 256,
                available: 64,
                ..
            })
        ));
        drop(writer);
        assert_eq!(engine.used_bytes(), 0);
        let block = write(&engine, &[pattern(4096, 1)]).await.unwrap();
        assert_eq!(engine.used_bytes(), 4096);
        drop(block);
        let again = write(&engine, &[pattern(4096, 2)]).await.unwrap();
        assert_eq!(
            engine.read(&again, 0, 4096).await.unwrap(),
            pattern(4096, 2)
        );
    }

    #[tokio::test]
    async fn pieces_filled_in_place_read_back() {
        let engine = DramEngine::open(1 << 16, false).unwrap();
        let data = pattern(5000, 4);
        let mut writer = engine.begin_write(5000).unwrap();
        writer.append(data.slice(..1000)).await.unwrap();
        let spare = writer.spare(4000).expect("the arena takes pieces in place");
        spare.copy_from_slice(&data[1000..]);
        writer.advance(4000);
        assert!(
            writer.spare(1).is_none(),
            "no spare memory past the block's end"
        );
        let block = writer.finish().await.unwrap();
        assert_eq!(engine.read(&block, 0, 5000).await.unwrap(), data);
    }

    #[tokio::test]
    async fn a_shared_arena_is_sealed_against_writers_and_reads_in_place() {
        use std::os::fd::AsRawFd;
        let engine = DramEngine::open_shared(1 << 20, true).unwrap();
        assert!(DramEngine::open(1 << 20, false)
            .unwrap()
            .shared_arena()
            .is_none());
        let arena = engine.shared_arena().expect("opened shared");
        assert_eq!(
            arena.len,
            (1 << 20) + PAGE_BYTES as u64,
            "a nonce page before the blocks"
        );
        let data = pattern(5000, 6);
        let block = write(&engine, std::slice::from_ref(&data)).await.unwrap();
        let read = engine.read(&block, 0, 5000).await.unwrap();
        let offset = arena.offset_of(&read).expect("the read lies in the arena");
        assert!(offset >= PAGE_BYTES as u64);
        // Another mapping of the memfd, as a reader of this host makes it: read-only works and
        // shows the block; a writable one is refused by the seal.
        let path = format!("/proc/self/fd/{}", arena.fd);
        let file = std::fs::File::open(&path).unwrap();
        let map = |prot: i32| {
            // SAFETY: a fresh shared mapping of the memfd, unmapped below.
            unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    arena.len as usize,
                    prot,
                    libc::MAP_SHARED,
                    file.as_raw_fd(),
                    0,
                )
            }
        };
        let reader = map(libc::PROT_READ);
        assert_ne!(reader, libc::MAP_FAILED);
        // SAFETY: inside the reader's mapping of `arena.len` bytes.
        let seen =
            unsafe { std::slice::from_raw_parts(reader.cast::<u8>().add(offset as usize), 5000) };
        assert_eq!(seen, &data[..]);
        // SAFETY: the nonce page is the mapping's first.
        let nonce = unsafe { std::slice::from_raw_parts(reader.cast::<u8>(), 16) };
        assert_eq!(nonce, arena.nonce);
        let rw = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        // SAFETY: an attempt at a writable shared mapping, refused by the seal.
        let writer = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                arena.len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                rw.as_raw_fd(),
                0,
            )
        };
        assert_eq!(
            writer,
            libc::MAP_FAILED,
            "the seal refuses new writable mappings"
        );
        // Nor may a holder of the descriptor change the bytes any other way.
        let at = offset as i64;
        // SAFETY: writing from a live buffer to a descriptor we own.
        let wrote = unsafe { libc::pwrite(rw.as_raw_fd(), b"xx".as_ptr().cast(), 2, at) };
        assert_eq!(wrote, -1, "the seal refuses write()");
        // SAFETY: as above, through the file position.
        let wrote = unsafe { libc::write(rw.as_raw_fd(), b"xx".as_ptr().cast(), 2) };
        assert_eq!(wrote, -1, "the seal refuses write()");
        // SAFETY: asking to make our own read-only mapping writable.
        let made_writable = unsafe {
            libc::mprotect(
                reader,
                arena.len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
        assert_eq!(
            made_writable, -1,
            "a read-only shared mapping stays read-only"
        );
        let len = PAGE_BYTES as i64;
        let page = at & !(len - 1);
        // SAFETY: punching a hole in a descriptor we own (refused by the seal).
        let punched = unsafe {
            libc::fallocate(
                rw.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                page,
                len,
            )
        };
        assert_eq!(punched, -1, "the seal refuses punching a hole");
        // SAFETY: advising our own shared mapping (refused: it would drop the arena's pages).
        let removed = unsafe {
            libc::madvise(
                reader.cast::<u8>().add(page as usize).cast(),
                PAGE_BYTES,
                libc::MADV_REMOVE,
            )
        };
        assert_eq!(removed, -1, "the seal refuses MADV_REMOVE");
        assert_eq!(seen, &data[..], "the block's bytes are unchanged");
        // SAFETY: unmapping the reader's mapping made above.
        unsafe { libc::munmap(reader, arena.len as usize) };
    }

    #[tokio::test]
    async fn length_mismatch_is_refused() {
        let engine = DramEngine::open(4096, false).unwrap();
        let mut writer = engine.begin_write(10).unwrap();
        assert!(matches!(
            writer.append(pattern(11, 0)).await,
            Err(StoreError::LengthMismatch {
                expected: 10,
                actual: 11
            })
        ));
        writer.append(pattern(5, 0)).await.unwrap();
        assert!(matches!(
            writer.finish().await,
            Err(StoreError::LengthMismatch {
                expected: 10,
                actual: 5
            })
        ));
        assert_eq!(engine.used_bytes(), 0);
    }
}
