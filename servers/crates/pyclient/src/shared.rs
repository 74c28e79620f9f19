//! `SharedView`: one object pinned in a storage server's shared arena, exported to Python as a
//! read-only buffer; the pin is released when the object (and so every memoryview of it) goes.

use std::os::raw::c_int;

use pocketflow_client::shared::Pinned;
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;

/// The bytes of one pinned object, read in place (`memoryview(view)`).
#[pyclass(name = "SharedView", module = "pocketflow._core", frozen)]
pub(crate) struct PySharedView {
    pinned: Pinned,
}

impl PySharedView {
    pub(crate) fn new(pinned: Pinned) -> Self {
        Self { pinned }
    }
}

#[pymethods]
impl PySharedView {
    /// Export the bytes, read-only; the exporter (this object) lives while any export does.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if flags & pyo3::ffi::PyBUF_WRITABLE != 0 {
            return Err(PyBufferError::new_err("a shared view is read-only"));
        }
        let bytes = slf.get().pinned.bytes();
        // SAFETY: `view` is the caller's buffer struct; the pointer stays valid while `slf`
        // lives, which the filled view holds a reference to.
        let filled = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                bytes.as_ptr() as *mut std::ffi::c_void,
                bytes.len() as pyo3::ffi::Py_ssize_t,
                1,
                flags,
            )
        };
        if filled != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.pinned.bytes().len()
    }
}
