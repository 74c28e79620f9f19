//! Memory lent across the GIL boundary: the caller's buffers read or filled in place while the
//! GIL is released, and the `bytes` objects a read allocates once at their final size.

use pocketflow_client::{ClientError, Destination};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// Memory the caller lent for the length of one call, usable without the GIL.
pub(crate) struct Lent {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
}

// SAFETY: the memory is owned by a Python object that the calling frame keeps alive (and, for a
// buffer, exported) until the call returns; only the thread running the call touches it.
unsafe impl Send for Lent {}

impl Lent {
    /// The bytes; valid while the lender is held.
    pub(crate) unsafe fn slice(&self) -> &[u8] {
        std::slice::from_raw_parts(self.ptr, self.len)
    }

    /// The bytes, writable, for as long as the caller says; valid while the lender is held.
    pub(crate) unsafe fn into_slice_mut<'a>(self) -> &'a mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }

    /// The bytes, writable, borrowed from this lender (one writer at a time); valid while the
    /// lender is held.
    pub(crate) unsafe fn slice_mut(&mut self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }
}

pub(crate) fn readable(buffer: &PyBuffer<u8>) -> PyResult<Lent> {
    if !buffer.is_c_contiguous() {
        return Err(PyValueError::new_err("the buffer must be C-contiguous"));
    }
    Ok(Lent {
        ptr: buffer.buf_ptr() as *mut u8,
        len: buffer.len_bytes(),
    })
}

/// A destination to fill: a writable C-contiguous buffer (`bytearray`, a writable
/// `memoryview`, an `mmap`, ...). Never a `bytes`: it is immutable and may be shared (CPython
/// keeps one object per one-byte value), so writing into it would change other values too.
pub(crate) fn writable(dest: &Bound<'_, PyAny>) -> PyResult<(Lent, PyBuffer<u8>)> {
    if dest.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(
            "the destination must be writable (a bytearray or a writable buffer), not bytes",
        ));
    }
    let buffer = PyBuffer::<u8>::get(dest)?;
    if buffer.readonly() {
        return Err(PyTypeError::new_err(
            "the destination buffer is read-only: pass a bytearray or a writable buffer",
        ));
    }
    let lent = readable(&buffer)?;
    Ok((lent, buffer))
}

/// Reads into a fresh `bytes` of at least this many bytes ask for transparent huge pages.
/// CPython takes such a `bytes` from `malloc`, and glibc maps every allocation above its
/// largest mmap threshold (32 MiB on 64-bit) afresh and unmaps it on free, so each such read
/// would fault in and zero its memory 4 KiB at a time: 16,384 faults per 64 MiB read, about
/// three quarters of a 64 MiB `get()`'s CPU time (measured). Smaller reads are left alone: glibc
/// serves them from memory it keeps and reuses, so their pages are usually in already.
pub(crate) const HUGE_PAGES_FROM_BYTES: usize = 32 * 1024 * 1024;
/// Bytes of a transparent huge page on x86-64 and arm64 Linux (4 KiB base pages).
const HUGE_PAGE_BYTES: usize = 2 * 1024 * 1024;

/// Ask the kernel to back the whole huge pages inside `[ptr, ptr + len)` with transparent huge
/// pages when they are first touched (one fault and one 2 MiB clear per huge page). Only a hint:
/// where the kernel has them off, or has none free, the memory works as before.
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    let start = (ptr as usize).next_multiple_of(HUGE_PAGE_BYTES);
    let end = (ptr as usize + len) / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
    if end > start {
        // SAFETY: the range lies inside memory the caller owns; the advice changes how its
        // pages are backed, never their contents (none were written yet).
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

/// A fresh `bytes` object of `size` bytes whose contents are not initialised: only for a
/// read that fills every byte before anything else sees the object (on failure it is dropped
/// unseen). From `HUGE_PAGES_FROM_BYTES` on, its memory asks for huge pages.
pub(crate) fn uninit_bytes(py: Python<'_>, size: usize) -> PyResult<Bound<'_, PyBytes>> {
    let length = pyo3::ffi::Py_ssize_t::try_from(size)
        .map_err(|_| PyValueError::new_err(format!("{size} bytes is too large")))?;
    // SAFETY: a NULL source makes CPython allocate without copying; the result is owned.
    let made: Bound<'_, PyBytes> = unsafe {
        let raw = pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), length);
        Bound::from_owned_ptr_or_err(py, raw)?.cast_into_unchecked()
    };
    if size >= HUGE_PAGES_FROM_BYTES {
        advise_huge_pages(made.as_bytes().as_ptr() as *mut u8, size);
    }
    Ok(made)
}

/// A read's destination: a `bytes` of the object's exact size, allocated once its size is
/// known (taking the GIL for the allocation only), filled in place and then returned.
#[derive(Default)]
pub(crate) struct NewBytes {
    pub(crate) made: Option<Py<PyBytes>>,
    memory: Option<Lent>,
}

impl Destination for NewBytes {
    fn buffer(&mut self, size: usize) -> Result<&mut [u8], ClientError> {
        let made = Python::attach(|py| uninit_bytes(py, size).map(Bound::unbind)).map_err(|e| {
            ClientError::InvalidArgument(format!("cannot allocate {size} bytes: {e}"))
        })?;
        let memory = Python::attach(|py| {
            let bytes = made.bind(py);
            Lent {
                ptr: bytes.as_bytes().as_ptr() as *mut u8,
                len: size,
            }
        });
        self.made = Some(made);
        // SAFETY: the `bytes` is held in `self.made` and seen by nobody else until the read ends.
        Ok(unsafe { self.memory.insert(memory).slice_mut() })
    }
}

/// A read's destination lent by the caller: fits if the object does.
pub(crate) struct CallerBuffer {
    pub(crate) memory: Lent,
}

impl Destination for CallerBuffer {
    fn buffer(&mut self, size: usize) -> Result<&mut [u8], ClientError> {
        if size > self.memory.len {
            return Err(ClientError::InvalidArgument(format!(
                "buffer of {} bytes is too small for {size} bytes",
                self.memory.len
            )));
        }
        // SAFETY: the caller's buffer is held (and exported) until the read returns.
        Ok(unsafe { self.memory.slice_mut() })
    }

    fn room(&self) -> Option<usize> {
        Some(self.memory.len)
    }
}
