//! A best-fit extent allocator with coalescing over one byte range (a DRAM arena or an NVMe file).
//!
//! Free space is kept in two ordered sets: by offset (to coalesce a freed extent with its
//! neighbours in O(log n)) and by (length, offset) (to find the smallest free extent that fits in
//! O(log n), lowest offset first). Every length is rounded up to the allocator's granularity, so
//! offsets and lengths of extents are always multiples of it: 64 bytes (a cache line) for DRAM,
//! 4096 bytes (the O_DIRECT alignment) for NVMe. The number of free extents is bounded by
//! `capacity / granularity`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

use crate::error::{CapacityLimit, StoreError};

/// Allocates extents of one byte range; shared (behind `Arc`) by an engine and its extents.
#[derive(Debug)]
pub struct ExtentAllocator {
    granularity_bytes: u64,
    capacity_bytes: u64,
    /// Mirror of the allocated bytes, readable without the lock.
    used_bytes: AtomicU64,
    /// Of `used_bytes`, extents whose block is gone but whose writes are still in the kernel
    /// (NVMe write-behind): free as soon as the device completes them.
    freeing_bytes: AtomicU64,
    /// Woken after every free, for allocations that wait for freeing extents.
    freed: Notify,
    free: Mutex<FreeSpace>,
}

#[derive(Debug, Default)]
struct FreeSpace {
    by_offset: BTreeMap<u64, u64>,
    by_len: BTreeSet<(u64, u64)>,
    free_bytes: u64,
}

impl FreeSpace {
    fn insert(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_len.insert((len, offset));
    }

    fn remove(&mut self, offset: u64, len: u64) {
        let had_offset = self.by_offset.remove(&offset).is_some();
        let had_len = self.by_len.remove(&(len, offset));
        assert!(
            had_offset && had_len,
            "free extent {offset}+{len} missing from an index"
        );
    }
}

/// One allocated extent; dropping it returns the space to its allocator.
#[derive(Debug)]
pub struct Extent {
    offset: u64,
    len: u64,
    allocator: Arc<ExtentAllocator>,
    /// Counted in the allocator's `freeing_bytes` (see [`Extent::mark_freeing`]).
    freeing: AtomicBool,
}

impl Extent {
    /// Byte offset of the extent in the engine's range (a multiple of the granularity).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Allocated length in bytes (a multiple of the granularity).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the extent is empty (never true: allocations are at least one granule).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether this extent was allocated by `allocator`.
    pub fn belongs_to(&self, allocator: &Arc<ExtentAllocator>) -> bool {
        Arc::ptr_eq(&self.allocator, allocator)
    }

    /// Count the extent as being freed: its block is gone and only writes still in the kernel
    /// hold it, so an allocation that needs its space waits for them
    /// ([`ExtentAllocator::allocate_waiting`]). Counted once, until the extent is freed.
    pub(crate) fn mark_freeing(&self) {
        if !self.freeing.swap(true, Ordering::AcqRel) {
            self.allocator
                .freeing_bytes
                .fetch_add(self.len, Ordering::AcqRel);
        }
    }
}

impl Drop for Extent {
    fn drop(&mut self) {
        self.allocator.free(self.offset, self.len);
        // Uncounted only once free, so that a waiting allocation never sees the bytes neither
        // free nor freeing.
        if *self.freeing.get_mut() {
            self.allocator
                .freeing_bytes
                .fetch_sub(self.len, Ordering::AcqRel);
        }
        self.allocator.freed.notify_waiters();
    }
}

impl ExtentAllocator {
    /// An allocator over `[0, capacity_bytes)` rounded down to a multiple of `granularity_bytes`.
    pub fn new(capacity_bytes: u64, granularity_bytes: u64) -> Arc<Self> {
        assert!(
            granularity_bytes.is_power_of_two(),
            "granularity must be a power of two"
        );
        let capacity_bytes = capacity_bytes / granularity_bytes * granularity_bytes;
        let mut free = FreeSpace::default();
        if capacity_bytes > 0 {
            free.insert(0, capacity_bytes);
            free.free_bytes = capacity_bytes;
        }
        Arc::new(Self {
            granularity_bytes,
            capacity_bytes,
            used_bytes: AtomicU64::new(0),
            freeing_bytes: AtomicU64::new(0),
            freed: Notify::new(),
            free: Mutex::new(free),
        })
    }

    /// Usable bytes (the range length rounded down to the granularity).
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Bytes currently allocated.
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes.load(Ordering::Relaxed)
    }

    /// Of the allocated bytes, those of deleted blocks that writes still in the kernel hold.
    pub fn freeing_bytes(&self) -> u64 {
        self.freeing_bytes.load(Ordering::Acquire)
    }

    /// Allocation unit in bytes.
    pub fn granularity_bytes(&self) -> u64 {
        self.granularity_bytes
    }

    /// Bytes an allocation of `len` occupies: `len` rounded up to the granularity, at least one
    /// granule.
    pub fn rounded_len(&self, len: u64) -> u64 {
        len.max(1).div_ceil(self.granularity_bytes) * self.granularity_bytes
    }

    fn lock(&self) -> MutexGuard<'_, FreeSpace> {
        self.free.lock().expect("allocator lock poisoned")
    }

    /// Allocate the smallest free extent that holds `len` bytes (rounded up to the granularity).
    pub fn allocate(self: &Arc<Self>, len: u64) -> Result<Extent, StoreError> {
        let rounded = self.rounded_len(len);
        let mut free = self.lock();
        let Some(&(found_len, offset)) = free.by_len.range((rounded, 0)..).next() else {
            return Err(StoreError::CapacityExhausted {
                requested: rounded,
                available: free.free_bytes,
                limit: CapacityLimit::Extent {
                    largest_free_bytes: free.by_len.last().map_or(0, |&(len, _)| len),
                },
            });
        };
        free.remove(offset, found_len);
        if found_len > rounded {
            free.insert(offset + rounded, found_len - rounded);
        }
        free.free_bytes -= rounded;
        self.used_bytes.fetch_add(rounded, Ordering::Relaxed);
        drop(free);
        debug_assert_eq!(offset % self.granularity_bytes, 0);
        debug_assert!(offset + rounded <= self.capacity_bytes);
        Ok(Extent {
            offset,
            len: rounded,
            allocator: Arc::clone(self),
            freeing: AtomicBool::new(false),
        })
    }

    /// [`ExtentAllocator::allocate`], but when it fails and the bytes still being freed would
    /// make room (extents of deleted blocks whose writes are in the kernel), wait for them to
    /// be freed, at most `wait_max`. Fails as `allocate` does when waiting cannot help, and with
    /// [`CapacityLimit::Freeing`] (which names the bytes being freed) when the wait ran out.
    pub async fn allocate_waiting(
        self: &Arc<Self>,
        len: u64,
        wait_max: Duration,
    ) -> Result<Extent, StoreError> {
        let deadline = tokio::time::Instant::now() + wait_max;
        loop {
            // Registered before the attempt, so that a free between the two is not missed.
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let full = match self.allocate(len) {
                Ok(extent) => return Ok(extent),
                Err(full) => full,
            };
            let StoreError::CapacityExhausted {
                requested,
                available,
                limit,
            } = full
            else {
                return Err(full);
            };
            let freeing_bytes = self.freeing_bytes();
            if freeing_bytes == 0 || available.saturating_add(freeing_bytes) < requested {
                return Err(StoreError::CapacityExhausted {
                    requested,
                    available,
                    limit,
                });
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                let largest_free_bytes = match limit {
                    CapacityLimit::Extent { largest_free_bytes } => largest_free_bytes,
                    _ => 0,
                };
                return Err(StoreError::CapacityExhausted {
                    requested,
                    available,
                    limit: CapacityLimit::Freeing {
                        freeing_bytes,
                        largest_free_bytes,
                        waited_ms: wait_max.as_millis() as u64,
                    },
                });
            }
        }
    }

    fn free(&self, offset: u64, len: u64) {
        assert!(
            offset % self.granularity_bytes == 0 && len % self.granularity_bytes == 0,
            "unaligned extent"
        );
        assert!(
            offset + len <= self.capacity_bytes,
            "extent {offset}+{len} outside the range"
        );
        let mut free = self.lock();
        let mut start = offset;
        let mut merged_len = len;
        if let Some((&prev_offset, &prev_len)) = free.by_offset.range(..offset).next_back() {
            assert!(
                prev_offset + prev_len <= offset,
                "double free of extent {offset}+{len}"
            );
            if prev_offset + prev_len == offset {
                free.remove(prev_offset, prev_len);
                start = prev_offset;
                merged_len += prev_len;
            }
        }
        if let Some((&next_offset, &next_len)) = free.by_offset.range(offset..).next() {
            assert!(
                offset + len <= next_offset,
                "double free of extent {offset}+{len}"
            );
            if offset + len == next_offset {
                free.remove(next_offset, next_len);
                merged_len += next_len;
            }
        }
        free.insert(start, merged_len);
        free.free_bytes += len;
        self.used_bytes.fetch_sub(len, Ordering::Relaxed);
        debug_assert_eq!(
            free.free_bytes + self.used_bytes.load(Ordering::Relaxed),
            self.capacity_bytes
        );
    }

    /// Number of free extents (fragmentation; 1 when everything is free).
    pub fn free_extent_count(&self) -> usize {
        self.lock().by_offset.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn allocations_wait_for_extents_being_freed_bounded() {
        use std::time::{Duration, Instant};
        const WHOLE: u64 = 64 * 1024;
        let allocator = ExtentAllocator::new(WHOLE, 4096);
        // A deleted block whose write is still in the kernel: the write holds the extent.
        let block = Arc::new(allocator.allocate(WHOLE).unwrap());
        let write = Arc::clone(&block);
        block.mark_freeing();
        block.mark_freeing();
        drop(block);
        assert_eq!(allocator.freeing_bytes(), WHOLE);
        assert!(matches!(
            allocator.allocate(4096),
            Err(StoreError::CapacityExhausted { .. })
        ));
        // A write that needs the room waits for the write to complete, and gets it.
        let completes = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(write);
        });
        let extent = allocator
            .allocate_waiting(WHOLE, Duration::from_secs(10))
            .await
            .unwrap();
        completes.await.unwrap();
        assert_eq!((extent.len(), allocator.freeing_bytes()), (WHOLE, 0));
        // A write that never completes: the wait is bounded, and the error says what holds the
        // room instead of calling the free space fragmented.
        let block = Arc::new(extent);
        let write = Arc::clone(&block);
        block.mark_freeing();
        drop(block);
        let started = Instant::now();
        let error = allocator
            .allocate_waiting(8192, Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(started.elapsed() >= Duration::from_millis(100));
        assert!(
            matches!(
                error,
                StoreError::CapacityExhausted {
                    requested: 8192,
                    available: 0,
                    limit: CapacityLimit::Freeing {
                        freeing_bytes: WHOLE,
                        largest_free_bytes: 0,
                        waited_ms: 100,
                    },
                }
            ),
            "{error:?}"
        );
        assert_eq!(
            error.to_string(),
            "tier has no free extent of 8192 bytes: 0 bytes free (the largest extent 0 bytes), \
             and 65536 bytes of deleted blocks are still held by their writes to the device \
             after a wait of 100 ms"
        );
        // Room that the bytes being freed cannot make: refused at once, as before.
        let started = Instant::now();
        let too_big = allocator
            .allocate_waiting(2 * WHOLE, Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(matches!(
            too_big,
            StoreError::CapacityExhausted {
                limit: CapacityLimit::Extent { .. },
                ..
            }
        ));
        drop(write);
        assert_eq!((allocator.used_bytes(), allocator.freeing_bytes()), (0, 0));
    }

    #[test]
    fn rounds_to_granularity_and_coalesces() {
        let allocator = ExtentAllocator::new(1000, 64);
        assert_eq!(allocator.capacity_bytes(), 960);
        let a = allocator.allocate(1).unwrap();
        let b = allocator.allocate(65).unwrap();
        let c = allocator.allocate(64).unwrap();
        assert_eq!((a.offset(), a.len()), (0, 64));
        assert_eq!((b.offset(), b.len()), (64, 128));
        assert_eq!((c.offset(), c.len()), (192, 64));
        assert_eq!(allocator.used_bytes(), 256);
        drop(a);
        drop(c);
        assert_eq!(allocator.free_extent_count(), 2);
        drop(b);
        assert_eq!(allocator.free_extent_count(), 1);
        assert_eq!(allocator.used_bytes(), 0);
    }

    #[test]
    fn best_fit_picks_the_smallest_hole() {
        let allocator = ExtentAllocator::new(64 * 10, 64);
        let extents: Vec<_> = (0..10).map(|_| allocator.allocate(64).unwrap()).collect();
        let mut extents: Vec<Option<Extent>> = extents.into_iter().map(Some).collect();
        // Holes: [1..4) of 3 granules and [6..7) of 1 granule.
        for i in [1, 2, 3, 6] {
            extents[i] = None;
        }
        let small = allocator.allocate(64).unwrap();
        assert_eq!(small.offset(), 6 * 64);
        let large = allocator.allocate(128).unwrap();
        assert_eq!(large.offset(), 64);
    }

    #[test]
    fn exhaustion_is_typed_and_leaves_state_intact() {
        let allocator = ExtentAllocator::new(4096 * 4, 4096);
        let _a = allocator.allocate(4096 * 3).unwrap();
        match allocator.allocate(4097) {
            Err(StoreError::CapacityExhausted {
                requested,
                available,
                limit: CapacityLimit::Extent { largest_free_bytes },
            }) => {
                assert_eq!(
                    (requested, available, largest_free_bytes),
                    (8192, 4096, 4096)
                );
            }
            other => panic!("expected capacity_exhausted, got {other:?}"),
        }
        assert_eq!(allocator.used_bytes(), 4096 * 3);
        assert!(allocator.allocate(1).is_ok());
    }
}
