//! `Listing`: a listing of a bucket in progress, an iterator of pages.

use pocketflow_client::{ClientError, Failure, Listing};
use pyo3::prelude::*;

use crate::errors::failure_to_py;

/// A listing in progress: iterate for its pages.
#[pyclass(name = "Listing", module = "pocketflow._core", frozen)]
pub(crate) struct PyListing {
    pub(crate) listing: std::sync::Mutex<Listing>,
}

#[pymethods]
impl PyListing {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Vec<(String, u64)>>> {
        let listing = &self.listing;
        py.detach(|| {
            listing
                .lock()
                .map_err(|_| ClientError::Protocol("a listing's lock was poisoned".into()))
                .map_err(|e| Failure {
                    error: e,
                    server: String::new(),
                })
                .and_then(|mut listing| listing.next_page())
        })
        .map_err(|f| failure_to_py(py, &f))
    }
}
