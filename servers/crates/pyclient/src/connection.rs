//! `Connection`: one storage server's connection (small operations, data blocks, actions).

use std::sync::Arc;

use bytes::Bytes;
use pocketflow_client::{block_on, BlockSlice, ClientError, Connection, RangeTarget};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::convert::{connection_config, replies_list, reply_tuple, request_of, requests_of};
use crate::errors::to_py_err;
use crate::memory::{readable, writable};
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

    /// Run many small operations pipelined over one session, at most `window` in flight.
    /// `ops` holds `(op, flags, bucket, key, header, value)` tuples; returns one
    /// `(status, header or None, body)` per op, in order.
    fn run<'py>(
        &self,
        py: Python<'py>,
        command: &[u8],
        epoch: u64,
        ops: &Bound<'py, PyList>,
        window: usize,
    ) -> PyResult<Bound<'py, PyList>> {
        let requests = requests_of(ops)?;
        let command = Bytes::copy_from_slice(command);
        let connection = &self.connection;
        let result = py.detach(|| connection.exchange_blocking(&command, epoch, &requests, window));
        replies_list(py, result, connection.address())
    }

    /// Write data blocks over one DoPut stream; `blocks` holds `(index, buffer)` pairs, read
    /// in place (no copy before the message body). Returns the server's JSON result bytes.
    fn put_blocks<'py>(
        &self,
        py: Python<'py>,
        command: &[u8],
        blocks: &Bound<'py, PyList>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mut held: Vec<(u32, PyBuffer<u8>)> = Vec::with_capacity(blocks.len());
        for item in blocks.iter() {
            let (index, data): (u32, Bound<'py, PyAny>) = item.extract()?;
            held.push((index, PyBuffer::<u8>::get(&data)?));
        }
        let mut lent = Vec::with_capacity(held.len());
        for (index, buffer) in &held {
            lent.push((*index, readable(buffer)?));
        }
        let command = Bytes::copy_from_slice(command);
        let connection = &self.connection;
        let result = py.detach(move || {
            // SAFETY: `held` keeps every buffer exported until this call returns.
            let slices: Vec<BlockSlice<'_>> = lent
                .iter()
                .map(|(index, lent)| BlockSlice {
                    index: *index,
                    data: unsafe { lent.slice() },
                })
                .collect();
            connection.put_blocks_blocking(command, &slices)
        });
        drop(held);
        match result {
            Ok(body) => Ok(PyBytes::new(py, &body)),
            Err(e) => Err(to_py_err(py, &e, connection.address())),
        }
    }

    /// Read the ranges of a DoGet ticket into `dest` (a writable buffer, or a `bytes` made by
    /// `empty_bytes` that nothing else has seen yet). `ranges` holds
    /// `(block, offset, length, dest_at)` in ticket order. Returns `(received per range,
    /// error or None)`: an error after some ranges arrived comes with their counts.
    fn get_ranges<'py>(
        &self,
        py: Python<'py>,
        ticket: &[u8],
        ranges: Vec<(u32, u64, u64, usize)>,
        dest: &Bound<'py, PyAny>,
    ) -> PyResult<(Vec<u64>, Option<PyErr>)> {
        let targets: Vec<RangeTarget> = ranges
            .iter()
            .map(|&(block, offset, len, dest_at)| RangeTarget {
                block,
                offset,
                len,
                dest_at,
            })
            .collect();
        let (lent, _held) = writable(dest)?;
        let ticket = Bytes::copy_from_slice(ticket);
        let connection = &self.connection;
        let result = py.detach(move || {
            // SAFETY: `_held` keeps the destination alive (and exported) until we return.
            let dest = unsafe { lent.slice_mut() };
            connection.get_ranges_blocking(ticket, &targets, dest)
        });
        match result {
            Ok(outcome) => Ok((
                outcome.received,
                outcome
                    .error
                    .map(|e| to_py_err(py, &e, connection.address())),
            )),
            Err(e) => Err(to_py_err(py, &e, connection.address())),
        }
    }

    /// Open sessions until the pool holds `count` (at most its bound) and keep them idle;
    /// returns how many it holds.
    fn warm(&self, py: Python<'_>, command: &[u8], count: usize) -> PyResult<usize> {
        let command = Bytes::copy_from_slice(command);
        let connection = &self.connection;
        py.detach(|| connection.warm_blocking(&command, count))
            .map_err(|e| to_py_err(py, &e, connection.address()))
    }

    /// Run one DoAction; returns its first result body (`b""` when none).
    fn action<'py>(
        &self,
        py: Python<'py>,
        name: &str,
        body: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        let body = Bytes::copy_from_slice(body);
        let connection = &self.connection;
        // An action may be a parked `wait` of many seconds: look at Python's signals every
        // SIGNAL_CHECK_INTERVAL so Ctrl-C ends it (dropping the call cancels its RPC).
        let result: Result<Bytes, ClientError> = py.detach(|| -> PyResult<_> {
            block_on(async {
                let call = connection.action(name, body);
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
