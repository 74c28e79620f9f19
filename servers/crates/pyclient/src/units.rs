//! The one size and duration grammar (`pocketflow_protocol::units`) for the Python package:
//! `pocketflow.config.parse_size` and `parse_duration` parse every string through these.

use pocketflow_protocol::units;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Bytes of a size string (`"64MiB"`, `"1.5 GB"`); `ValueError` saying why it is not one.
#[pyfunction]
pub(crate) fn parse_size(text: &str) -> PyResult<u64> {
    units::parse_size(text).map_err(|e| PyValueError::new_err(e.0))
}

/// Nanoseconds of a duration string (`"30s"`, `"500ms"`, `"2"`); `ValueError` saying why it is
/// not one.
#[pyfunction]
pub(crate) fn parse_duration_ns(text: &str) -> PyResult<u64> {
    units::parse_duration(text)
        .map(|d| d.as_nanos() as u64)
        .map_err(|e| PyValueError::new_err(e.0))
}
