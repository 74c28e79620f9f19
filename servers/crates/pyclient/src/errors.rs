//! The one place a core error becomes a Python exception.

use pocketflow_client::{ClientError, Failure};
use pyo3::prelude::*;
use pyo3::types::IntoPyDict;

/// The one place a core error becomes a Python exception: `pocketflow.errors.error_from_grpc`
/// picks the class from the code and the kind the message starts with.
pub(crate) fn to_py_err(py: Python<'_>, error: &ClientError, server: &str) -> PyErr {
    let built = py
        .import("pocketflow.errors")
        .and_then(|errors| errors.getattr("error_from_grpc"))
        .and_then(|from_grpc| {
            let kwargs = [("server", server)].into_py_dict(py)?;
            from_grpc.call((error.code(), error.to_string()), Some(&kwargs))
        });
    match built {
        Ok(exception) => PyErr::from_value(exception),
        Err(import_failed) => import_failed,
    }
}

pub(crate) fn failure_to_py(py: Python<'_>, failure: &Failure) -> PyErr {
    to_py_err(py, &failure.error, &failure.server)
}
