//! `Upload`: a streamed upload of one object's data blocks, then its commit.

use pocketflow_client::{Failure, StreamUpload};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::errors::failure_to_py;
use crate::memory::readable;

/// A block of a streamed upload: the caller's buffer, held (exported) until it is sent.
pub(crate) struct HeldBlock(PyBuffer<u8>);

impl AsRef<[u8]> for HeldBlock {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the buffer was checked C-contiguous and stays exported while held.
        unsafe { std::slice::from_raw_parts(self.0.buf_ptr() as *const u8, self.0.len_bytes()) }
    }
}

fn upload_failure(py: Python<'_>, failure: &Failure) -> PyErr {
    failure_to_py(py, failure)
}

/// A streamed upload (`pocketflow_client::StreamUpload`).
///
/// Lock order: the interpreter lock is never held while waiting for `upload`'s mutex (every
/// method that locks it releases the GIL first), because a call holding the mutex may need the
/// GIL to release a caller's buffer.
#[pyclass(name = "Upload", module = "pocketflow._core", frozen)]
pub(crate) struct PyUpload {
    pub(crate) upload: std::sync::Mutex<StreamUpload<HeldBlock>>,
    /// The upload's version, fixed at its start (read without the mutex).
    pub(crate) version: u64,
}

impl PyUpload {
    pub(crate) fn new(upload: StreamUpload<HeldBlock>) -> Self {
        PyUpload {
            version: upload.version(),
            upload: std::sync::Mutex::new(upload),
        }
    }

    fn locked(&self) -> std::sync::MutexGuard<'_, StreamUpload<HeldBlock>> {
        // A panic while locked leaves an upload whose state is still consistent to abort.
        self.upload.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl PyUpload {
    /// The version the object gets.
    #[getter]
    fn version(&self) -> u64 {
        self.version
    }

    /// Queue data block `index` (1-based; any C-contiguous buffer, held until sent); may wait
    /// for a send to finish, and raises the failure of an earlier send.
    fn add(&self, py: Python<'_>, index: u32, block: &Bound<'_, PyAny>) -> PyResult<()> {
        let buffer = PyBuffer::<u8>::get(block)?;
        readable(&buffer)?;
        let held = HeldBlock(buffer);
        py.detach(|| self.locked().add(index, held))
            .map_err(|f| upload_failure(py, &f))
    }

    /// Send what is queued, wait, and store the manifest of an object of `size` bytes.
    fn commit(&self, py: Python<'_>, size: u64, overwrite: bool) -> PyResult<()> {
        py.detach(|| self.locked().commit(size, overwrite))
            .map_err(|f| upload_failure(py, &f))
    }

    /// Discard the upload, freeing every block sent (nothing after a commit was attempted).
    fn abort(&self, py: Python<'_>) {
        py.detach(|| self.locked().abort());
    }
}

impl Drop for PyUpload {
    /// An upload the garbage collector drops before its commit frees what it sent: that joins
    /// its sends and calls servers, so it runs with the interpreter lock released.
    fn drop(&mut self) {
        let upload = self.upload.get_mut().unwrap_or_else(|p| p.into_inner());
        Python::attach(|py| py.detach(|| upload.abort()));
    }
}
