//! Page-aligned I/O buffers for O_DIRECT, recycled through a bounded pool.
//!
//! O_DIRECT needs the buffer address, file offset and length aligned to the logical block size;
//! we align everything to [`IO_ALIGN_BYTES`]. Buffers are zeroed once when first allocated and
//! reused afterwards, so steady-state I/O neither faults in fresh pages nor zeroes memory again.

use std::alloc::{self, Layout};
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// Alignment of buffers, file offsets and lengths of direct I/O.
pub const IO_ALIGN_BYTES: usize = 4096;

/// A zero-initialised, [`IO_ALIGN_BYTES`]-aligned heap buffer; returns to its pool on drop.
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    pool: Option<Arc<BufferPool>>,
}

// SAFETY: the buffer is a unique heap allocation, like a `Box<[u8]>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads through `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A fresh zeroed buffer of `len` bytes (a non-zero multiple of [`IO_ALIGN_BYTES`]).
    pub fn zeroed(len: usize) -> Self {
        assert!(
            len > 0 && len % IO_ALIGN_BYTES == 0,
            "aligned buffer length {len}"
        );
        let layout = Layout::from_size_align(len, IO_ALIGN_BYTES).expect("aligned buffer layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        Self {
            ptr,
            len,
            pool: None,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never true).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Pointer for the kernel to read from.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Pointer for the kernel to write into.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid and initialised for `len` bytes while `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            let buf = AlignedBuf {
                ptr: self.ptr,
                len: self.len,
                pool: None,
            };
            if let Some(rejected) = pool.put(buf) {
                drop(rejected);
            }
            return;
        }
        let layout =
            Layout::from_size_align(self.len, IO_ALIGN_BYTES).expect("aligned buffer layout");
        // SAFETY: allocated in `zeroed` with this layout and not freed before.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// Keeps released buffers, by exact length, up to `pooled_bytes_max` bytes in total.
#[derive(Debug)]
pub struct BufferPool {
    pooled_bytes_max: usize,
    state: Mutex<PoolState>,
}

#[derive(Debug, Default)]
struct PoolState {
    pooled_bytes: usize,
    by_len: HashMap<usize, Vec<AlignedBuf>>,
}

impl BufferPool {
    /// A pool that keeps at most `pooled_bytes_max` bytes of idle buffers.
    pub fn new(pooled_bytes_max: usize) -> Arc<Self> {
        Arc::new(Self {
            pooled_bytes_max,
            state: Mutex::new(PoolState::default()),
        })
    }

    /// A buffer of `len` bytes (a multiple of [`IO_ALIGN_BYTES`]), reused if one is idle.
    /// Its contents are arbitrary (zeroes or earlier data).
    pub fn take(self: &Arc<Self>, len: usize) -> AlignedBuf {
        let reused = {
            let mut state = self.state.lock().expect("buffer pool lock poisoned");
            let buf = state.by_len.get_mut(&len).and_then(Vec::pop);
            if buf.is_some() {
                state.pooled_bytes -= len;
            }
            buf
        };
        let mut buf = reused.unwrap_or_else(|| AlignedBuf::zeroed(len));
        buf.pool = Some(Arc::clone(self));
        buf
    }

    /// Keep `buf` for reuse, or hand it back if the pool is full.
    fn put(&self, buf: AlignedBuf) -> Option<AlignedBuf> {
        let mut state = self.state.lock().expect("buffer pool lock poisoned");
        if state.pooled_bytes + buf.len > self.pooled_bytes_max {
            return Some(buf);
        }
        state.pooled_bytes += buf.len;
        state.by_len.entry(buf.len).or_default().push(buf);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_recycled() {
        let pool = BufferPool::new(3 * IO_ALIGN_BYTES);
        let mut a = pool.take(2 * IO_ALIGN_BYTES);
        assert_eq!(a.as_ptr() as usize % IO_ALIGN_BYTES, 0);
        assert!(a.iter().all(|&b| b == 0));
        a[0] = 7;
        let address = a.as_ptr();
        drop(a);
        let b = pool.take(2 * IO_ALIGN_BYTES);
        assert_eq!(b.as_ptr(), address);
        // The pool holds at most 3 pages, so a second 2-page buffer is freed, not kept.
        let c = pool.take(2 * IO_ALIGN_BYTES);
        drop(b);
        drop(c);
        assert_eq!(pool.state.lock().unwrap().pooled_bytes, 2 * IO_ALIGN_BYTES);
    }
}
