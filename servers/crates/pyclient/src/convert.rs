//! Arguments and replies between Python and the core: exchange requests from Python values,
//! replies and headers as tuples, and a connection's bounds from keyword arguments.

use std::time::Duration;

use bytes::Bytes;
use pocketflow_client::{ClientTls, ConnectionConfig, ExchangeReply, ExchangeRequest, Record};
use pocketflow_protocol::frame::OpCode;
use pocketflow_protocol::header::{ObjectHeader, HEADER_LEN_BYTES};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::errors::to_py_err;
use crate::memory::readable;

pub(crate) fn header_of(raw: &[u8]) -> PyResult<ObjectHeader> {
    if raw.len() != HEADER_LEN_BYTES {
        return Err(PyValueError::new_err(format!(
            "an object header is {HEADER_LEN_BYTES} bytes, got {}",
            raw.len()
        )));
    }
    ObjectHeader::decode(raw).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A record the client read from `server`, as Python hands it back: its header as 32 bytes
/// and its value (a small object's body, or a manifest's value).
pub(crate) fn record_of(server: &str, header: &[u8], body: &[u8]) -> PyResult<Record> {
    Ok(Record {
        server: server.to_string(),
        header: Some(header_of(header)?),
        body: Bytes::copy_from_slice(body),
    })
}

pub(crate) fn utf8(raw: &[u8], what: &str) -> PyResult<String> {
    String::from_utf8(raw.to_vec())
        .map_err(|_| PyValueError::new_err(format!("the {what} is not UTF-8")))
}

pub(crate) fn request_of(
    op: u8,
    flags: u8,
    bucket: &[u8],
    key: &[u8],
    header: &[u8],
    value: &Bound<'_, PyAny>,
) -> PyResult<ExchangeRequest> {
    let op = OpCode::from_code(op).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let value = if value.is_none() {
        Bytes::new()
    } else {
        let buffer = PyBuffer::<u8>::get(value)?;
        let lent = readable(&buffer)?;
        // SAFETY: `buffer` is held for the copy.
        Bytes::copy_from_slice(unsafe { lent.slice() })
    };
    Ok(ExchangeRequest {
        op,
        flags,
        bucket: utf8(bucket, "bucket")?,
        key: utf8(key, "key")?,
        header: header_of(header)?,
        value,
    })
}

/// A header as `(version, size, block_count, block_size, flags)` (cheaper for Python than
/// bytes to unpack), or `None`.
pub(crate) fn header_fields(
    py: Python<'_>,
    header: Option<ObjectHeader>,
) -> PyResult<Bound<'_, PyAny>> {
    Ok(match header {
        Some(h) => (h.version, h.size, h.block_count, h.block_size, h.flags)
            .into_pyobject(py)?
            .into_any(),
        None => py.None().into_bound(py),
    })
}

pub(crate) fn reply_tuple<'py>(
    py: Python<'py>,
    reply: &ExchangeReply,
) -> PyResult<Bound<'py, PyTuple>> {
    let header = header_fields(py, reply.header)?;
    PyTuple::new(
        py,
        [
            reply.status.into_pyobject(py)?.into_any(),
            header,
            PyBytes::new(py, &reply.body).into_any(),
        ],
    )
}

/// The bounds of a connection from the keyword arguments of `Connection` and `Objects`;
/// `timeouts_s` is `[op, first reply, rpc, stream]`.
pub(crate) fn connection_config(
    py: Python<'_>,
    address: &str,
    sessions_max: usize,
    timeouts_s: [f64; 4],
    direct: bool,
    tls_ca: Option<&[u8]>,
) -> PyResult<ConnectionConfig> {
    let names = [
        "op_timeout_s",
        "first_reply_timeout_s",
        "rpc_timeout_s",
        "stream_timeout_s",
    ];
    let mut timeouts = [Duration::ZERO; 4];
    for ((slot, seconds), name) in timeouts.iter_mut().zip(timeouts_s).zip(names) {
        *slot = Duration::try_from_secs_f64(seconds)
            .map_err(|_| PyValueError::new_err(format!("{name} must be >= 0, got {seconds}")))?;
    }
    let [op_timeout, first_reply_timeout, rpc_timeout, stream_timeout] = timeouts;
    Ok(ConnectionConfig {
        sessions_max: sessions_max.max(1),
        op_timeout,
        first_reply_timeout,
        rpc_timeout,
        stream_timeout,
        direct,
        tls: match tls_ca {
            Some(pem) => Some(ClientTls::from_ca_pem(pem).map_err(|e| to_py_err(py, &e, address))?),
            None => None,
        },
    })
}
