//! The NVMe engine: blocks live in a file or block device opened with O_DIRECT, driven by io_uring.
//!
//! The file is extended to the capacity up front (fallocate), so writes never hit ENOSPC and the
//! engine's [`ExtentAllocator`] (4 KiB granularity) bounds the space. Writers copy pieces into
//! aligned staging chunks of at most `write_chunk_bytes` and keep up to `writer_inflight_max`
//! chunk writes in the kernel; readers read the aligned span around the requested range into one
//! buffer and return a zero-copy slice of it. All staging memory (write chunks and read buffers
//! until the caller drops the returned `Bytes`) is bounded by a semaphore of
//! `staging_bytes_max`, counted in 4 KiB pages.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use pocketflow_protocol::limits::BLOCK_SIZE_MAX_BYTES;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

use super::buffer::{AlignedBuf, BufferPool, IO_ALIGN_BYTES};
use super::uring::{IoCompletion, IoKind, IoRequest, Uring};
use super::write_behind::WriteBehind;
use super::{assert_read_back, BlockWriter, Checksum, Engine, EngineFuture, StoredBlock, Tier};
use crate::allocator::{Extent, ExtentAllocator};
use crate::error::StoreError;

/// Allocation granularity and direct-I/O alignment of the NVMe engine.
pub const NVME_GRANULARITY_BYTES: u64 = IO_ALIGN_BYTES as u64;

/// Longest a new write waits for room that deleted blocks' writes still hold (write-behind)
/// before it fails as `capacity_exhausted`: at most `staging_bytes_max` are written behind, which
/// a working device completes in well under this.
pub const FREEING_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// Settings of an [`NvmeEngine`]; [`NvmeConfig::new`] gives the defaults.
#[derive(Clone, Debug)]
pub struct NvmeConfig {
    /// File (created if missing) or block device holding the blocks.
    pub path: PathBuf,
    /// Usable bytes, rounded down to 4 KiB; a file is extended to this size.
    pub capacity_bytes: u64,
    /// Most I/O operations in the kernel at once.
    pub queue_depth: u32,
    /// Bound on aligned staging memory (write chunks, read buffers not yet dropped).
    pub staging_bytes_max: u64,
    /// Size of one write operation of a block writer.
    pub write_chunk_bytes: u64,
    /// Most chunk writes one block writer keeps in the kernel.
    pub writer_inflight_max: usize,
}

impl NvmeConfig {
    /// Default queue depth.
    pub const QUEUE_DEPTH_DEFAULT: u32 = 64;
    /// Default staging-memory bound.
    pub const STAGING_BYTES_MAX_DEFAULT: u64 = 128 * 1024 * 1024;
    /// Default write chunk size.
    pub const WRITE_CHUNK_BYTES_DEFAULT: u64 = 1024 * 1024;
    /// Default per-writer window of chunk writes.
    pub const WRITER_INFLIGHT_MAX_DEFAULT: usize = 4;

    /// Defaults for `capacity_bytes` at `path`.
    pub fn new(path: impl Into<PathBuf>, capacity_bytes: u64) -> Self {
        Self {
            path: path.into(),
            capacity_bytes,
            queue_depth: Self::QUEUE_DEPTH_DEFAULT,
            staging_bytes_max: Self::STAGING_BYTES_MAX_DEFAULT,
            write_chunk_bytes: Self::WRITE_CHUNK_BYTES_DEFAULT,
            writer_inflight_max: Self::WRITER_INFLIGHT_MAX_DEFAULT,
        }
    }
}

/// Stores blocks in a file or block device through O_DIRECT and io_uring.
pub struct NvmeEngine {
    allocator: Arc<ExtentAllocator>,
    shared: Arc<Shared>,
}

struct Shared {
    path: PathBuf,
    uring: Uring,
    staging: Arc<Semaphore>,
    pool: Arc<BufferPool>,
    write_chunk_bytes: u64,
    writer_inflight_max: usize,
}

impl Shared {
    /// Reserve staging memory for a buffer of `len` bytes and take one from the pool.
    async fn buffer(&self, len: u64) -> Result<(AlignedBuf, OwnedSemaphorePermit), StoreError> {
        let pages = u32::try_from(len / NVME_GRANULARITY_BYTES).expect("buffer below 16 TiB");
        let permit = Arc::clone(&self.staging)
            .acquire_many_owned(pages)
            .await
            .map_err(|_| StoreError::EngineStopped)?;
        Ok((self.pool.take(len as usize), permit))
    }

    fn check(&self, op: &'static str, completion: &IoCompletion) -> Result<(), StoreError> {
        match &completion.result {
            Ok(done) if *done == completion.buf.len() => Ok(()),
            Ok(done) => {
                let short = io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("short transfer: {done} of {} bytes", completion.buf.len()),
                );
                Err(StoreError::io(op, &self.path, short))
            }
            Err(error) => Err(StoreError::io(
                op,
                &self.path,
                io::Error::from_raw_os_error(error.raw_os_error().unwrap_or(libc::EIO)),
            )),
        }
    }
}

impl NvmeEngine {
    /// The writer of a block of `len` bytes in `extent`.
    fn writer(&self, extent: Extent, len: u64) -> Box<dyn BlockWriter> {
        Box::new(NvmeWriter {
            shared: Arc::clone(&self.shared),
            extent: WriterExtent(Some(Arc::new(extent))),
            len,
            written: 0,
            chunk: None,
            in_flight: Default::default(),
            checksum: Checksum::default(),
            failed: false,
        })
    }

    /// Open (creating and extending a file as needed) the path of `config` with O_DIRECT and
    /// set up its io_uring ring.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime with I/O enabled: the ring's completions are reaped by a task on
    /// the runtime that opens the engine.
    pub fn open(config: NvmeConfig) -> Result<Self, StoreError> {
        let path = config.path.clone();
        let capacity_bytes =
            config.capacity_bytes / NVME_GRANULARITY_BYTES * NVME_GRANULARITY_BYTES;
        if capacity_bytes == 0 {
            return Err(StoreError::CapacityTooSmall {
                capacity_bytes: config.capacity_bytes,
                min_bytes: NVME_GRANULARITY_BYTES,
            });
        }
        let chunk_ok =
            config.write_chunk_bytes > 0 && config.write_chunk_bytes % NVME_GRANULARITY_BYTES == 0;
        assert!(chunk_ok, "write chunk must be a positive multiple of 4 KiB");
        // Any single read or write buffer must fit the staging bound, or it would wait forever.
        let largest_buffer = u64::from(BLOCK_SIZE_MAX_BYTES) + 2 * NVME_GRANULARITY_BYTES;
        assert!(
            config.staging_bytes_max >= largest_buffer.max(config.write_chunk_bytes),
            "staging bound below one buffer"
        );
        let file = open_direct(&path, capacity_bytes)?;
        let uring = Uring::start(Arc::new(file), config.queue_depth)?;
        let staging_pages = (config.staging_bytes_max / NVME_GRANULARITY_BYTES) as usize;
        let shared = Shared {
            path,
            uring,
            staging: Arc::new(Semaphore::new(staging_pages.min(Semaphore::MAX_PERMITS))),
            pool: BufferPool::new(config.staging_bytes_max as usize),
            write_chunk_bytes: config.write_chunk_bytes,
            writer_inflight_max: config.writer_inflight_max.max(1),
        };
        Ok(Self {
            allocator: ExtentAllocator::new(capacity_bytes, NVME_GRANULARITY_BYTES),
            shared: Arc::new(shared),
        })
    }

    /// The file or device path.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }
}

/// Open `path` for direct I/O, sized to at least `capacity_bytes`, and prove a direct read works.
fn open_direct(path: &Path, capacity_bytes: u64) -> Result<File, StoreError> {
    let is_device = std::fs::metadata(path)
        .map(|m| m.file_type().is_block_device())
        .unwrap_or(false);
    let opened = OpenOptions::new()
        .read(true)
        .write(true)
        .create(!is_device)
        .custom_flags(libc::O_DIRECT)
        .open(path);
    let mut file = match opened {
        Ok(file) => file,
        Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
            return Err(StoreError::DirectIoUnsupported {
                path: path.to_path_buf(),
            });
        }
        Err(error) => return Err(StoreError::io("open", path, error)),
    };
    if is_device {
        let device_bytes = file
            .seek(SeekFrom::End(0))
            .map_err(|e| StoreError::io("size block device", path, e))?;
        if device_bytes < capacity_bytes {
            return Err(StoreError::CapacityExceedsDevice {
                path: path.to_path_buf(),
                capacity_bytes,
                device_bytes,
            });
        }
    } else {
        let len = i64::try_from(capacity_bytes).expect("capacity below 8 EiB");
        // SAFETY: fallocate on an fd we own, no pointers.
        if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) } != 0 {
            let error = io::Error::last_os_error();
            if error.raw_os_error() != Some(libc::EOPNOTSUPP) {
                return Err(StoreError::io("fallocate", path, error));
            }
            let current = file
                .metadata()
                .map_err(|e| StoreError::io("stat", path, e))?
                .len();
            if current < capacity_bytes {
                file.set_len(capacity_bytes)
                    .map_err(|e| StoreError::io("extend", path, e))?;
            }
        }
    }
    // Some file systems accept O_DIRECT at open and refuse it at the first I/O.
    let mut probe = AlignedBuf::zeroed(IO_ALIGN_BYTES);
    // SAFETY: reading into a live, aligned buffer of exactly the given length.
    let read = unsafe { libc::pread(file.as_raw_fd(), probe.as_mut_ptr().cast(), probe.len(), 0) };
    if read < 0 {
        let error = io::Error::last_os_error();
        if error.raw_os_error() == Some(libc::EINVAL) {
            return Err(StoreError::DirectIoUnsupported {
                path: path.to_path_buf(),
            });
        }
        return Err(StoreError::io("probe read", path, error));
    }
    Ok(file)
}

fn align_down(value: u64) -> u64 {
    value / NVME_GRANULARITY_BYTES * NVME_GRANULARITY_BYTES
}

fn align_up(value: u64) -> u64 {
    value.div_ceil(NVME_GRANULARITY_BYTES) * NVME_GRANULARITY_BYTES
}

impl Engine for NvmeEngine {
    fn tier(&self) -> Tier {
        Tier::Nvme
    }

    fn capacity_bytes(&self) -> u64 {
        self.allocator.capacity_bytes()
    }

    fn used_bytes(&self) -> u64 {
        self.allocator.used_bytes()
    }

    fn freeing_bytes(&self) -> u64 {
        self.allocator.freeing_bytes()
    }

    fn allocation_bytes(&self, len: u64) -> u64 {
        self.allocator.rounded_len(len)
    }

    fn begin_write(&self, len: u64) -> Result<Box<dyn BlockWriter>, StoreError> {
        assert!(len >= 1, "engine blocks hold at least one byte");
        let extent = self.allocator.allocate(len)?;
        Ok(self.writer(extent, len))
    }

    fn begin_write_waiting(&self, len: u64) -> EngineFuture<'_, Box<dyn BlockWriter>> {
        assert!(len >= 1, "engine blocks hold at least one byte");
        Box::pin(async move {
            let extent = self
                .allocator
                .allocate_waiting(len, FREEING_WAIT_MAX)
                .await?;
            Ok(self.writer(extent, len))
        })
    }

    fn read(&self, block: &StoredBlock, offset: u64, len: u64) -> EngineFuture<'static, Bytes> {
        assert!(
            block.belongs_to(&self.allocator),
            "block read from another engine"
        );
        block.assert_range(offset, len);
        let shared = Arc::clone(&self.shared);
        let block = block.clone();
        Box::pin(async move {
            block
                .written()
                .await
                .map_err(|cause| StoreError::DataLost {
                    path: shared.path.clone(),
                    cause,
                })?;
            if len == 0 {
                return Ok(Bytes::new());
            }
            let start = block.offset() + offset;
            let span_start = align_down(start);
            let span_len = align_up(start + len) - span_start;
            let (buf, permit) = shared.buffer(span_len).await?;
            let request = IoRequest {
                kind: IoKind::Read,
                file_offset: span_start,
                buf,
                permit: Some(permit),
                keep_alive: Some(Box::new(block.clone())),
            };
            let completion = shared.uring.run(request).await?;
            shared.check("io_uring read", &completion)?;
            let skip = (start - span_start) as usize;
            let held = ReadBuffer {
                buf: completion.buf,
                _permit: completion.permit,
            };
            let bytes = Bytes::from_owner(held).slice(skip..skip + len as usize);
            assert_read_back(&block, offset, len, &bytes);
            Ok(bytes)
        })
    }
}

/// Owner of a read's bytes: the aligned buffer and its staging permit, released together.
struct ReadBuffer {
    buf: AlignedBuf,
    _permit: Option<OwnedSemaphorePermit>,
}

impl AsRef<[u8]> for ReadBuffer {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

/// The chunk being filled: an aligned buffer destined for one file offset.
struct Chunk {
    buf: AlignedBuf,
    permit: OwnedSemaphorePermit,
    file_offset: u64,
    filled: usize,
    data_len: usize,
}

/// Writes one block as a sequence of aligned chunk writes.
/// A writer's hold on its extent. Dropped unfinished (a failed or abandoned put) while chunk
/// writes are still in the kernel, which hold the extent too, it counts the extent as being
/// freed, as a deleted block's: a write that needs the room waits for those writes.
struct WriterExtent(Option<Arc<Extent>>);

impl WriterExtent {
    fn get(&self) -> &Arc<Extent> {
        self.0
            .as_ref()
            .expect("a writer holds its extent until finished")
    }

    /// The extent, for the block the finished writer hands back.
    fn into_block(mut self) -> Arc<Extent> {
        self.0
            .take()
            .expect("a writer holds its extent until finished")
    }
}

impl Drop for WriterExtent {
    fn drop(&mut self) {
        if let Some(extent) = &self.0 {
            if Arc::strong_count(extent) > 1 {
                extent.mark_freeing();
            }
        }
    }
}

struct NvmeWriter {
    shared: Arc<Shared>,
    /// Shared with in-flight writes, so a dropped writer's extent is not reused under them.
    extent: WriterExtent,
    len: u64,
    written: u64,
    chunk: Option<Chunk>,
    in_flight: std::collections::VecDeque<oneshot::Receiver<IoCompletion>>,
    checksum: Checksum,
    failed: bool,
}

impl NvmeWriter {
    async fn start_chunk(&mut self) -> Result<(), StoreError> {
        let data_len = (self.len - self.written).min(self.shared.write_chunk_bytes);
        let (buf, permit) = self.shared.buffer(align_up(data_len)).await?;
        let file_offset = self.extent.get().offset() + self.written;
        self.chunk = Some(Chunk {
            buf,
            permit,
            file_offset,
            filled: 0,
            data_len: data_len as usize,
        });
        Ok(())
    }

    async fn submit_chunk(&mut self) -> Result<(), StoreError> {
        let Chunk {
            mut buf,
            permit,
            file_offset,
            filled,
            ..
        } = self.chunk.take().expect("a full chunk");
        // The padding up to the alignment is zeroed so no stale bytes reach the disk.
        buf[filled..].fill(0);
        let keep_alive: Box<dyn std::any::Any + Send> = Box::new(Arc::clone(self.extent.get()));
        let request = IoRequest {
            kind: IoKind::Write,
            file_offset,
            buf,
            permit: Some(permit),
            keep_alive: Some(keep_alive),
        };
        let completion = self.shared.uring.submit(request).await?;
        self.in_flight.push_back(completion);
        while self.in_flight.len() > self.shared.writer_inflight_max {
            self.reap_oldest().await?;
        }
        Ok(())
    }

    async fn reap_oldest(&mut self) -> Result<(), StoreError> {
        let receiver = self.in_flight.pop_front().expect("an in-flight write");
        let completion = receiver.await.map_err(|_| StoreError::EngineStopped)?;
        self.shared.check("io_uring write", &completion)
    }

    async fn append_piece(&mut self, piece: Bytes) -> Result<(), StoreError> {
        let actual = self.written + piece.len() as u64;
        if actual > self.len {
            return Err(StoreError::LengthMismatch {
                expected: self.len,
                actual,
            });
        }
        let mut rest = &piece[..];
        while !rest.is_empty() {
            if self.chunk.is_none() {
                self.start_chunk().await?;
            }
            let chunk = self.chunk.as_mut().expect("a chunk being filled");
            let n = rest.len().min(chunk.data_len - chunk.filled);
            chunk.buf[chunk.filled..chunk.filled + n].copy_from_slice(&rest[..n]);
            chunk.filled += n;
            let full = chunk.filled == chunk.data_len;
            self.checksum.update(&rest[..n]);
            self.written += n as u64;
            rest = &rest[n..];
            if full {
                self.submit_chunk().await?;
            }
        }
        Ok(())
    }
}

impl BlockWriter for NvmeWriter {
    fn append(&mut self, piece: Bytes) -> EngineFuture<'_, ()> {
        Box::pin(async move {
            if self.failed {
                return Err(StoreError::EngineStopped);
            }
            let result = self.append_piece(piece).await;
            self.failed =
                matches!(result, Err(ref e) if !matches!(e, StoreError::LengthMismatch { .. }));
            result
        })
    }

    fn finish(self: Box<Self>) -> EngineFuture<'static, StoredBlock> {
        let this = *self;
        Box::pin(async move {
            if this.written != this.len {
                return Err(StoreError::LengthMismatch {
                    expected: this.len,
                    actual: this.written,
                });
            }
            assert!(
                this.chunk.is_none(),
                "a complete block leaves no partial chunk"
            );
            // Write-behind: the last chunk writes (at most `writer_inflight_max`) complete
            // after the handle is returned; their staging permits bound them and their
            // completions are reaped by a task of their own, which settles the block's state.
            let NvmeWriter {
                shared,
                extent,
                len,
                checksum,
                in_flight,
                ..
            } = this;
            let extent = extent.into_block();
            if in_flight.is_empty() {
                return Ok(StoredBlock::with_writes(extent, len, checksum, None));
            }
            let (done, writes) = WriteBehind::start();
            tokio::spawn(async move {
                let mut outcome = Ok(());
                // Every write is awaited, also after a failure, so that the block's reads are
                // answered only once nothing of it is in the kernel any more.
                for receiver in in_flight {
                    let result = match receiver.await {
                        Ok(completion) => shared
                            .check("io_uring write", &completion)
                            .map_err(|error| error.to_string()),
                        Err(_) => Err(StoreError::EngineStopped.to_string()),
                    };
                    if outcome.is_ok() {
                        outcome = result;
                    }
                }
                done.settle(outcome);
            });
            Ok(StoredBlock::with_writes(
                extent,
                len,
                checksum,
                Some(writes),
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize, seed: u8) -> Bytes {
        (0..len)
            .map(|i| ((i * 7 + i / 4096) as u8).wrapping_add(seed))
            .collect::<Vec<_>>()
            .into()
    }

    fn small_config(dir: &tempfile::TempDir, capacity_bytes: u64) -> NvmeConfig {
        let mut config = NvmeConfig::new(dir.path().join("blocks"), capacity_bytes);
        config.queue_depth = 8;
        config.staging_bytes_max = 20 * 1024 * 1024;
        config.write_chunk_bytes = 64 * 1024;
        config.writer_inflight_max = 2;
        config
    }

    async fn write(engine: &NvmeEngine, pieces: &[Bytes]) -> Result<StoredBlock, StoreError> {
        let len = pieces.iter().map(|p| p.len() as u64).sum();
        let mut writer = engine.begin_write(len)?;
        for piece in pieces {
            writer.append(piece.clone()).await?;
        }
        let block = writer.finish().await?;
        // Settled, so that the tests' figures of used bytes do not depend on the device's pace.
        block.written().await.expect("the block's writes completed");
        Ok(block)
    }

    /// A loop device over a sparse file on a tmpfs of `tmpfs_bytes`: writes beyond what the
    /// tmpfs holds fail in the device (EIO) after the kernel took them. Removed on drop.
    /// `None` where the test cannot make one (not root, no loop devices).
    struct TinyDevice {
        mount: tempfile::TempDir,
        device: String,
    }

    impl TinyDevice {
        fn make(tmpfs_bytes: u64, device_bytes: u64) -> Option<Self> {
            use std::process::Command;
            let mount = tempfile::tempdir_in("/tmp").unwrap();
            let mounted = Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={tmpfs_bytes}"), "tmpfs"])
                .arg(mount.path())
                .status()
                .is_ok_and(|status| status.success());
            if !mounted {
                return None;
            }
            let file = mount.path().join("backing");
            File::create(&file).unwrap().set_len(device_bytes).unwrap();
            let attached = Command::new("losetup")
                .args(["--find", "--show"])
                .arg(&file)
                .output()
                .ok()
                .filter(|output| output.status.success());
            let Some(output) = attached else {
                let _ = Command::new("umount").arg(mount.path()).status();
                return None;
            };
            let device = String::from_utf8(output.stdout).unwrap().trim().to_string();
            Some(Self { mount, device })
        }
    }

    /// Tries to unmount a tiny device's tmpfs before a lazy unmount.
    const UNMOUNT_TRIES_MAX: usize = 50;

    impl Drop for TinyDevice {
        fn drop(&mut self) {
            use std::process::Command;
            let _ = Command::new("losetup").args(["-d", &self.device]).status();
            // The loop device lets go of its file a moment after the detach: a few tries, then
            // a lazy unmount, which completes once it has.
            for _ in 0..UNMOUNT_TRIES_MAX {
                let unmounted = Command::new("umount")
                    .arg(self.mount.path())
                    .stderr(std::process::Stdio::null())
                    .status()
                    .is_ok_and(|status| status.success());
                if unmounted {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let _ = Command::new("umount")
                .arg("-l")
                .arg(self.mount.path())
                .status();
        }
    }

    #[tokio::test]
    async fn a_write_failing_after_the_put_returned_fails_the_blocks_reads() {
        // One page of tmpfs under a 4 MiB device: a block's 64 KiB chunk cannot be stored.
        let Some(device) = TinyDevice::make(4096, 4 << 20) else {
            eprintln!("skipped: no tmpfs mount or loop device here (needs root)");
            return;
        };
        let mut config = small_config(&tempfile::tempdir_in("/tmp").unwrap(), 1 << 20);
        config.path = PathBuf::from(&device.device);
        let engine = NvmeEngine::open(config).unwrap();
        let data = pattern(100_000, 9);
        let mut writer = engine.begin_write(data.len() as u64).unwrap();
        writer.append(data.clone()).await.unwrap();
        // Its two chunks fit the writer's window: both are written behind the returned handle.
        let block = writer
            .finish()
            .await
            .expect("the put returns before its writes complete");
        let read = engine.read(&block, 0, block.len()).await;
        match read {
            Err(error @ StoreError::DataLost { .. }) => {
                assert_eq!(error.kind(), "data_lost");
                let StoreError::DataLost { path, cause } = error else {
                    unreachable!()
                };
                assert_eq!(path, Path::new(&device.device));
                assert!(cause.starts_with("io_uring write"), "{cause}");
            }
            other => panic!("a read of a block whose write failed: {other:?}"),
        }
        // Every later read says the same: the bytes are gone, not late.
        assert!(matches!(
            engine.read(&block, 0, 1).await,
            Err(StoreError::DataLost { .. })
        ));
        assert!(block.writes_settled());
        // The failed block's extent is freed with its last handle, as any other's.
        drop(block);
        assert_eq!(engine.used_bytes(), 0);
        drop(engine);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_block_dropped_with_writes_in_flight_frees_its_extent_after_them() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let engine = NvmeEngine::open(small_config(&dir, 1 << 20)).unwrap();
        for seed in 0..50u8 {
            let mut writer = engine.begin_write(100_000).unwrap();
            writer.append(pattern(100_000, seed)).await.unwrap();
            let block = writer.finish().await.unwrap();
            let settled_at_drop = block.writes_settled();
            drop(block);
            if settled_at_drop {
                assert_eq!(engine.used_bytes(), 0);
            }
            // Bounded wait for the kernel to finish the writes that hold the extent.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while engine.used_bytes() != 0 {
                assert!(std::time::Instant::now() < deadline, "extent never freed");
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            // The whole capacity is free again for the next block (a 1 MiB engine).
            let whole = engine.begin_write(1 << 20).unwrap();
            drop(whole);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_needing_a_deleted_blocks_room_waits_for_its_writes() {
        // Each round fills the whole 1 MiB engine with a block (its last chunks written
        // behind), drops it at once (a delete) and asks for the whole engine again: the room
        // is held until the dropped block's writes complete, and the new write waits for them
        // instead of failing as full.
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let engine = NvmeEngine::open(small_config(&dir, 1 << 20)).unwrap();
        let mut waited = 0;
        for seed in 0..50u8 {
            let mut writer = engine.begin_write_waiting(1 << 20).await.unwrap();
            writer.append(pattern(1 << 20, seed)).await.unwrap();
            let block = writer.finish().await.unwrap();
            if !block.writes_settled() {
                waited += 1;
            }
            drop(block);
        }
        let last = engine.begin_write_waiting(1 << 20).await.unwrap();
        drop(last);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while engine.used_bytes() != 0 || engine.freeing_bytes() != 0 {
            assert!(std::time::Instant::now() < deadline, "extent never freed");
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        eprintln!("{waited} of 50 rounds dropped a block with writes in flight");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_needing_an_abandoned_writers_room_waits_for_its_writes() {
        // Each round writes all but the last byte of a block as large as the 1 MiB engine (its
        // last chunk writes in the kernel) and drops the writer, as a put that failed midway:
        // the next write of the whole engine waits for those writes instead of failing.
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let engine = NvmeEngine::open(small_config(&dir, 1 << 20)).unwrap();
        for seed in 0..50u8 {
            let mut writer = engine.begin_write_waiting(1 << 20).await.unwrap();
            writer.append(pattern((1 << 20) - 1, seed)).await.unwrap();
            drop(writer);
        }
        let whole = engine.begin_write_waiting(1 << 20).await.unwrap();
        drop(whole);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while engine.used_bytes() != 0 || engine.freeing_bytes() != 0 {
            assert!(std::time::Instant::now() < deadline, "extent never freed");
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    #[tokio::test]
    async fn unaligned_lengths_and_offsets_round_trip() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let engine = NvmeEngine::open(small_config(&dir, 4 << 20)).unwrap();
        let data = pattern(300_001, 5);
        // Pieces that straddle chunk (64 KiB) and page boundaries.
        let cuts = [0, 1, 4095, 4097, 65_535, 65_537, 200_000, 300_001];
        let pieces: Vec<Bytes> = cuts.windows(2).map(|w| data.slice(w[0]..w[1])).collect();
        let block = write(&engine, &pieces).await.unwrap();
        assert_eq!(block.allocated_bytes(), align_up(300_001));
        assert_eq!(engine.read(&block, 0, 300_001).await.unwrap(), data);
        for (offset, len) in [
            (0u64, 1u64),
            (1, 4095),
            (4095, 2),
            (4096, 4096),
            (65_000, 70_000),
            (300_000, 1),
            (12_345, 0),
        ] {
            let got = engine.read(&block, offset, len).await.unwrap();
            assert_eq!(
                got,
                data.slice(offset as usize..(offset + len) as usize),
                "range {offset}+{len}"
            );
        }
        let tiny = write(&engine, &[pattern(3, 1)]).await.unwrap();
        assert_eq!(engine.read(&tiny, 0, 3).await.unwrap(), pattern(3, 1));
        assert_eq!(engine.used_bytes(), align_up(300_001) + 4096);
    }

    #[tokio::test]
    async fn exhaustion_free_and_reuse() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let engine = NvmeEngine::open(small_config(&dir, 64 * 1024)).unwrap();
        let first = write(&engine, &[pattern(40_000, 1)]).await.unwrap();
        let full = engine.begin_write(30_000);
        assert!(
            matches!(
                full,
                Err(StoreError::CapacityExhausted {
                    requested: 32_768,
                    available: 24_576,
                    ..
                })
            ),
            "{:?}",
            full.err()
        );
        assert_eq!(engine.used_bytes(), 40_960);
        let partial = {
            let mut writer = engine.begin_write(20_000).unwrap();
            writer.append(pattern(10_000, 2)).await.unwrap();
            writer
        };
        drop(partial);
        assert_eq!(
            engine.used_bytes(),
            40_960,
            "an unfinished writer frees its reservation"
        );
        drop(first);
        assert_eq!(engine.used_bytes(), 0);
        let reused = write(&engine, &[pattern(65_536, 3)]).await.unwrap();
        assert_eq!(reused.offset(), 0);
        assert_eq!(
            engine.read(&reused, 0, 65_536).await.unwrap(),
            pattern(65_536, 3)
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_writers_and_readers() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let engine = Arc::new(NvmeEngine::open(small_config(&dir, 16 << 20)).unwrap());
        let mut tasks = Vec::new();
        for seed in 0..32u8 {
            let engine = Arc::clone(&engine);
            tasks.push(tokio::spawn(async move {
                let data = pattern(100_000 + seed as usize * 1000, seed);
                let block = write(&engine, &[data.slice(..50_000), data.slice(50_000..)])
                    .await
                    .unwrap();
                for _ in 0..3 {
                    assert_eq!(engine.read(&block, 0, block.len()).await.unwrap(), data);
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(engine.used_bytes(), 0);
    }

    #[tokio::test]
    async fn tmpfs_is_refused_or_works() {
        // /dev/shm is tmpfs; kernels before 6.6 refuse O_DIRECT there. Either outcome must be
        // clean: a typed error naming the path, or a working engine.
        let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
            return;
        };
        match NvmeEngine::open(small_config(&dir, 1 << 20)) {
            Ok(_) => {}
            Err(StoreError::DirectIoUnsupported { path }) => assert!(path.starts_with(dir.path())),
            Err(other) => panic!("unexpected error {other}"),
        }
    }
}
