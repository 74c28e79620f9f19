//! `Connection`: one storage server's connection, for single small operations and actions (the
//! admin client's calls, and the control-plane actions of a job's client).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pocketflow_client::{block_on, ClientError, Connection};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::convert::{connection_config, reply_tuple, request_of};
use crate::errors::to_py_err;
use crate::SIGNAL_CHECK_INTERVAL;

/// A connection to one storage server (see `pocketflow/transport.py`).
#[pyclass(name = "Connection", module = "pocketflow._core", frozen)]
pub(crate) struct PyConnection {
    pub(crate) connection: Arc<Connection>,
}

#[pymethods]
impl PyConnection {
    #[new]
    #[pyo3(signature = (address, *, sessions_max, op_timeout_s, first_reply_timeout_s,
                        rpc_timeout_s, stream_timeout_s, direct=true, tls_ca=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        address: &str,
        sessions_max: usize,
        op_timeout_s: f64,
        first_reply_timeout_s: f64,
        rpc_timeout_s: f64,
        stream_timeout_s: f64,
        direct: bool,
        tls_ca: Option<&[u8]>,
    ) -> PyResult<Self> {
        let config = connection_config(
            py,
            address,
            sessions_max,
            [
                op_timeout_s,
                first_reply_timeout_s,
                rpc_timeout_s,
                stream_timeout_s,
            ],
            direct,
            tls_ca,
        )?;
        let connection =
            Connection::new(address, config).map_err(|e| to_py_err(py, &e, address))?;
        Ok(PyConnection {
            connection: Arc::new(connection),
        })
    }

    /// The server's `host:port`.
    #[getter]
    fn address(&self) -> &str {
        self.connection.address()
    }

    /// Run one small operation; returns `(status, header fields or None, body)`.
    #[allow(clippy::too_many_arguments)]
    fn call<'py>(
        &self,
        py: Python<'py>,
        command: &[u8],
        epoch: u64,
        op: u8,
        flags: u8,
        bucket: &[u8],
        key: &[u8],
        header: &[u8],
        value: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let request = request_of(op, flags, bucket, key, header, value)?;
        let command = Bytes::copy_from_slice(command);
        let connection = &self.connection;
        let result = py.detach(|| {
            connection.exchange_blocking(&command, epoch, std::slice::from_ref(&request), 1)
        });
        match result {
            Ok(replies) => reply_tuple(py, &replies[0]),
            Err(e) => Err(to_py_err(py, &e, connection.address())),
        }
    }

    /// Run one DoAction; returns its first result body (`b""` when none). It fails as
    /// unavailable after `timeout_s` (default: the connection's `rpc_timeout_s`).
    #[pyo3(signature = (name, body, *, timeout_s=None))]
    fn action<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        body: &[u8],
        timeout_s: Option<f64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let body = Bytes::copy_from_slice(body);
        let connection = &self.connection;
        let bound = match timeout_s {
            Some(seconds) => Some(seconds_bound(py, seconds, connection.address())?),
            None => None,
        };
        // An action may be a parked `wait` of many seconds: look at Python's signals every
        // SIGNAL_CHECK_INTERVAL so Ctrl-C ends it (dropping the call cancels its RPC).
        let result: Result<Bytes, ClientError> = py.detach(|| -> PyResult<_> {
            block_on(async {
                let call = async {
                    match bound {
                        Some(bound) => connection.action_within(name, body, bound).await,
                        None => connection.action(name, body).await,
                    }
                };
                tokio::pin!(call);
                loop {
                    tokio::select! {
                        done = &mut call => return Ok(done),
                        () = tokio::time::sleep(SIGNAL_CHECK_INTERVAL) => {
                            Python::attach(|py| py.check_signals())?;
                        }
                    }
                }
            })
        })?;
        match result {
            Ok(body) => Ok(PyBytes::new(py, &body)),
            Err(e) => Err(to_py_err(py, &e, connection.address())),
        }
    }

    /// Close the idle sessions; later calls fail.
    fn close(&self) {
        self.connection.close();
    }
}

/// A finite, non-negative `timeout_s` as a duration, else `InvalidRequest`.
fn seconds_bound(py: Python<'_>, seconds: f64, address: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds).map_err(|_| {
        let error = ClientError::InvalidArgument(format!(
            "timeout_s must be finite and >= 0, got {seconds}"
        ));
        to_py_err(py, &error, address)
    })
}
