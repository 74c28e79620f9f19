//! `pocketflow._core`: the Python face of the client core. Thin on purpose: it converts
//! arguments, releases the GIL around every blocking call, and maps the core's errors to
//! `pocketflow.errors` in one function ([`to_py_err`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pocketflow_client::channels::{check_placed_ops, PLACED_OPS_MAX};
use pocketflow_client::placement::{PlacedServer, Placement, Routes};
use pocketflow_client::waits::Stop;
use pocketflow_client::{
    block_on, BlockSlice, ClientError, ClientTls, Connection, ConnectionConfig, Destination,
    ExchangeReply, ExchangeRequest, Failure, Listing, Objects, RangeTarget, StreamUpload, Tuning,
};
use pocketflow_protocol::frame::OpCode;
use pocketflow_protocol::header::{ObjectHeader, HEADER_LEN_BYTES};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

/// The one place a core error becomes a Python exception: `pocketflow.errors.error_from_grpc`
/// picks the class from the code and the kind the message starts with.
fn to_py_err(py: Python<'_>, error: &ClientError, server: &str) -> PyErr {
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

use pyo3::types::IntoPyDict;

/// Memory the caller lent for the length of one call, usable without the GIL.
struct Lent {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the memory is owned by a Python object that the calling frame keeps alive (and, for a
// buffer, exported) until the call returns; only the thread running the call touches it.
unsafe impl Send for Lent {}

impl Lent {
    /// The bytes; valid while the lender is held.
    unsafe fn slice(&self) -> &[u8] {
        std::slice::from_raw_parts(self.ptr, self.len)
    }

    /// The bytes, writable, for as long as the caller says; valid while the lender is held.
    unsafe fn into_slice_mut<'a>(self) -> &'a mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }

    /// The bytes, writable; valid while the lender is held.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }
}

fn readable(buffer: &PyBuffer<u8>) -> PyResult<Lent> {
    if !buffer.is_c_contiguous() {
        return Err(PyValueError::new_err("the buffer must be C-contiguous"));
    }
    Ok(Lent {
        ptr: buffer.buf_ptr() as *mut u8,
        len: buffer.len_bytes(),
    })
}

fn header_of(raw: &[u8]) -> PyResult<ObjectHeader> {
    if raw.len() != HEADER_LEN_BYTES {
        return Err(PyValueError::new_err(format!(
            "an object header is {HEADER_LEN_BYTES} bytes, got {}",
            raw.len()
        )));
    }
    ObjectHeader::decode(raw).map_err(|e| PyValueError::new_err(e.to_string()))
}

fn utf8(raw: &[u8], what: &str) -> PyResult<String> {
    String::from_utf8(raw.to_vec())
        .map_err(|_| PyValueError::new_err(format!("the {what} is not UTF-8")))
}

fn request_of(
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
fn header_fields(py: Python<'_>, header: Option<ObjectHeader>) -> PyResult<Bound<'_, PyAny>> {
    Ok(match header {
        Some(h) => (h.version, h.size, h.block_count, h.block_size, h.flags)
            .into_pyobject(py)?
            .into_any(),
        None => py.None().into_bound(py),
    })
}

fn reply_tuple<'py>(py: Python<'py>, reply: &ExchangeReply) -> PyResult<Bound<'py, PyTuple>> {
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

/// `(op, flags, bucket, key, header, value)` tuples as requests.
fn requests_of(ops: &Bound<'_, PyList>) -> PyResult<Vec<ExchangeRequest>> {
    let mut requests = Vec::with_capacity(ops.len());
    for item in ops.iter() {
        let (op, flags, bucket, key, header, value): (
            u8,
            u8,
            Vec<u8>,
            Vec<u8>,
            Vec<u8>,
            Bound<'_, PyAny>,
        ) = item.extract()?;
        requests.push(request_of(op, flags, &bucket, &key, &header, &value)?);
    }
    Ok(requests)
}

/// The replies of one run as a list of `(status, header or None, body)`, or its error.
fn replies_list<'py>(
    py: Python<'py>,
    result: Result<Vec<ExchangeReply>, ClientError>,
    server: &str,
) -> PyResult<Bound<'py, PyList>> {
    match result {
        Ok(replies) => {
            let list = PyList::empty(py);
            for reply in &replies {
                list.append(reply_tuple(py, reply)?)?;
            }
            Ok(list)
        }
        Err(e) => Err(to_py_err(py, &e, server)),
    }
}

/// Weighted rendezvous placement over one weight map (`pocketflow_client::placement`, the same
/// picks as `pocketflow/placement.py`), for batches: one call places many keys.
#[pyclass(name = "Placement", module = "pocketflow._core", frozen)]
struct PyPlacement {
    placement: Placement,
}

#[pymethods]
impl PyPlacement {
    /// `servers` holds `(node_id, weight, persist)` in the weight map's order; `pools` (name ->
    /// node ids) and `routes` (key prefix -> pool name) are the map's optional prefix routes.
    #[new]
    #[pyo3(signature = (servers, pools=None, routes=None))]
    fn new(
        py: Python<'_>,
        servers: Vec<(String, f64, bool)>,
        pools: Option<BTreeMap<String, Vec<String>>>,
        routes: Option<BTreeMap<String, String>>,
    ) -> PyResult<Self> {
        let routes = Routes::new(pools.unwrap_or_default(), routes.unwrap_or_default())
            .map_err(|e| to_py_err(py, &e, ""))?;
        let placed: Vec<PlacedServer> = servers
            .into_iter()
            .map(|(node_id, weight, persist)| PlacedServer {
                node_id,
                weight,
                persist,
            })
            .collect();
        Ok(PyPlacement {
            placement: Placement::with_routes(&placed, routes),
        })
    }

    /// The index (in the map's order) of the server for block `block` of each key (`bytes`),
    /// or -1 where no server can hold it.
    #[pyo3(signature = (keys, block=0, persist=false))]
    fn servers_for(
        &self,
        keys: &Bound<'_, PyList>,
        block: u32,
        persist: bool,
    ) -> PyResult<Vec<i64>> {
        let mut out = Vec::with_capacity(keys.len());
        for key in keys.iter() {
            let key = key.cast::<PyBytes>()?;
            out.push(
                self.placement
                    .server_for(key.as_bytes(), block, persist)
                    .map_or(-1, |i| i as i64),
            );
        }
        Ok(out)
    }
}

/// How often a long call looks at Python's pending signals (Ctrl-C), with the GIL taken briefly.
const SIGNAL_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// A connection to one storage server (see `pocketflow/transport.py`).
#[pyclass(name = "Connection", module = "pocketflow._core", frozen)]
struct PyConnection {
    connection: Arc<Connection>,
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

/// The bounds of a connection from the keyword arguments of `Connection` and `Objects`;
/// `timeouts_s` is `[op, first reply, rpc, stream]`.
fn connection_config(
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

fn failure_to_py(py: Python<'_>, failure: &Failure) -> PyErr {
    to_py_err(py, &failure.error, &failure.server)
}

/// A fresh `bytes` object of `size` bytes whose contents are not initialised: only for a
/// read that fills every byte before anything else sees the object (on failure it is dropped
/// unseen).
fn uninit_bytes(py: Python<'_>, size: usize) -> PyResult<Bound<'_, PyBytes>> {
    let length = pyo3::ffi::Py_ssize_t::try_from(size)
        .map_err(|_| PyValueError::new_err(format!("{size} bytes is too large")))?;
    // SAFETY: a NULL source makes CPython allocate without copying; the result is owned.
    unsafe {
        let raw = pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), length);
        Ok(Bound::from_owned_ptr_or_err(py, raw)?.cast_into_unchecked())
    }
}

/// A read's destination: a `bytes` of the object's exact size, allocated once its size is
/// known (taking the GIL for the allocation only), filled in place and then returned.
#[derive(Default)]
struct NewBytes {
    made: Option<Py<PyBytes>>,
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
struct CallerBuffer {
    memory: Lent,
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

/// The object layer of one job's client (`pocketflow_client::Objects`): the job's current
/// weight map, its connections, and the read path of objects.
#[pyclass(name = "Objects", module = "pocketflow._core", frozen)]
struct PyObjects {
    objects: Arc<Objects>,
}

#[pymethods]
impl PyObjects {
    #[new]
    #[pyo3(signature = (handle_json, *, sessions_max, op_timeout_s, first_reply_timeout_s,
                        rpc_timeout_s, stream_timeout_s, io_threads, exchange_window,
                        direct=true, tls_ca=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        handle_json: &str,
        sessions_max: usize,
        op_timeout_s: f64,
        first_reply_timeout_s: f64,
        rpc_timeout_s: f64,
        stream_timeout_s: f64,
        io_threads: usize,
        exchange_window: usize,
        direct: bool,
        tls_ca: Option<&[u8]>,
    ) -> PyResult<Self> {
        let config = connection_config(
            py,
            "",
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
        let tuning = Tuning {
            io_threads,
            exchange_window,
        };
        let objects =
            Objects::new(handle_json, config, tuning).map_err(|e| to_py_err(py, &e, ""))?;
        Ok(PyObjects {
            objects: Arc::new(objects),
        })
    }

    /// A number that changes whenever the weight map in use does.
    fn generation(&self) -> u64 {
        self.objects.generation()
    }

    /// The handle in use, as `JobHandle.to_json` writes it.
    fn handle_json(&self) -> String {
        self.objects.view().handle_json()
    }

    /// Use this handle from now on.
    fn set_handle(&self, py: Python<'_>, handle_json: &str) -> PyResult<()> {
        self.objects
            .set_handle(handle_json)
            .map_err(|e| to_py_err(py, &e, ""))
    }

    /// Adopt a weight map (JSON) if it is newer than the one in use; returns whether it was.
    fn adopt_weight_map(&self, py: Python<'_>, weight_map_json: &str) -> PyResult<bool> {
        let map: serde_json::Map<String, serde_json::Value> = serde_json::from_str(weight_map_json)
            .map_err(|e| PyValueError::new_err(format!("weight map: {e}")))?;
        self.objects
            .adopt_weight_map(&map)
            .map_err(|e| to_py_err(py, &e, ""))
    }

    /// The connection to `address` (one per server, shared with every read of this client).
    fn connection(&self, py: Python<'_>, address: &str) -> PyResult<PyConnection> {
        let connection = self
            .objects
            .connection(address)
            .map_err(|e| to_py_err(py, &e, address))?;
        Ok(PyConnection { connection })
    }

    /// Close every connection; with `reopen` later calls make new ones.
    #[pyo3(signature = (*, reopen))]
    fn close(&self, reopen: bool) {
        self.objects.close(reopen);
    }

    /// The object's bytes, in a `bytes` of its exact size; with `delete` it is removed as read.
    #[pyo3(signature = (bucket, key, *, delete=false))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        bucket: &str,
        key: &str,
        delete: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mut dest = NewBytes::default();
        let objects = &self.objects;
        let outcome = py.detach(|| objects.get(bucket, key, delete, &mut dest));
        outcome.map_err(|f| failure_to_py(py, &f))?;
        let made = dest
            .made
            .take()
            .expect("a successful read allocated its bytes");
        Ok(made.into_bound(py))
    }

    /// Read the object into `buffer` (writable, C-contiguous); returns its size. A buffer that
    /// is too small fails, and a DELETE read then puts the object back.
    #[pyo3(signature = (bucket, key, buffer, *, delete=false))]
    fn get_into(
        &self,
        py: Python<'_>,
        bucket: &str,
        key: &str,
        buffer: &Bound<'_, PyAny>,
        delete: bool,
    ) -> PyResult<usize> {
        let (memory, _held) = writable(buffer)?;
        let mut dest = CallerBuffer { memory };
        let objects = &self.objects;
        py.detach(|| objects.get(bucket, key, delete, &mut dest))
            .map_err(|f| failure_to_py(py, &f))
    }

    /// Bytes `[offset, offset + length)` of the object, cut at its end.
    fn get_range<'py>(
        &self,
        py: Python<'py>,
        bucket: &str,
        key: &str,
        offset: u64,
        length: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mut dest = NewBytes::default();
        let objects = &self.objects;
        py.detach(|| objects.get_range(bucket, key, offset, length, &mut dest))
            .map_err(|f| failure_to_py(py, &f))?;
        let made = dest
            .made
            .take()
            .expect("a successful read allocated its bytes");
        Ok(made.into_bound(py))
    }

    /// Store `data` (any C-contiguous buffer, read in place) under `key`; write-once unless
    /// `overwrite`.
    #[pyo3(signature = (bucket, key, data, *, persist=false, overwrite=false))]
    fn put(
        &self,
        py: Python<'_>,
        bucket: &str,
        key: &str,
        data: &Bound<'_, PyAny>,
        persist: bool,
        overwrite: bool,
    ) -> PyResult<()> {
        let held = PyBuffer::<u8>::get(data)?;
        let memory = readable(&held)?;
        let objects = &self.objects;
        py.detach(move || {
            // SAFETY: `held` keeps the buffer exported until this call returns.
            let data = unsafe { memory.slice() };
            objects.put(bucket, key, data, persist, overwrite)
        })
        .map_err(|f| failure_to_py(py, &f))
    }

    /// Store many `(key, buffer)` items; returns how many were stored.
    #[pyo3(signature = (bucket, items, *, persist=false, overwrite=false))]
    fn put_many(
        &self,
        py: Python<'_>,
        bucket: &str,
        items: Vec<(String, Bound<'_, PyAny>)>,
        persist: bool,
        overwrite: bool,
    ) -> PyResult<usize> {
        let mut held = Vec::with_capacity(items.len());
        for (_, data) in &items {
            held.push(PyBuffer::<u8>::get(data)?);
        }
        let mut lent = Vec::with_capacity(held.len());
        for ((key, _), buffer) in items.iter().zip(&held) {
            lent.push((key.as_str(), readable(buffer)?));
        }
        let objects = &self.objects;
        let outcome = py.detach(move || {
            // SAFETY: `held` keeps every buffer exported until this call returns.
            let slices: Vec<(&str, &[u8])> = lent
                .iter()
                .map(|(key, memory)| (*key, unsafe { memory.slice() }))
                .collect();
            objects.put_many(bucket, &slices, persist, overwrite)
        });
        drop(held);
        outcome.map_err(|f| failure_to_py(py, &f))
    }

    /// Free a version's data blocks (header as 32 bytes), best effort.
    fn delete_blocks(
        &self,
        py: Python<'_>,
        bucket: &str,
        key: &str,
        header: &[u8],
    ) -> PyResult<()> {
        let header = header_of(header)?;
        let objects = &self.objects;
        py.detach(|| objects.delete_blocks(bucket, key, &header));
        Ok(())
    }

    /// Free the given blocks (`{address: [index, ...]}`) of one version, servers in parallel;
    /// returns `(address, error)` for each server that failed.
    fn delete_block_groups<'py>(
        &self,
        py: Python<'py>,
        bucket: &str,
        key: &str,
        version: u64,
        groups: std::collections::HashMap<String, Vec<u32>>,
    ) -> PyResult<Vec<(String, PyErr)>> {
        let groups = groups
            .into_iter()
            .map(|(address, blocks)| (address, blocks.into_iter().collect()))
            .collect();
        let objects = &self.objects;
        let failures = py.detach(|| objects.delete_block_groups(bucket, key, version, &groups));
        Ok(failures
            .iter()
            .map(|f| (f.server.clone(), failure_to_py(py, f)))
            .collect())
    }

    /// A streamed upload of `bucket/key`: add its data blocks as they come, then commit.
    #[pyo3(signature = (bucket, key, *, persist))]
    fn upload(&self, bucket: &str, key: &str, persist: bool) -> PyUpload {
        PyUpload {
            upload: std::sync::Mutex::new(StreamUpload::new(
                self.objects.clone(),
                bucket,
                key,
                persist,
            )),
        }
    }

    /// A listing of `bucket` under `prefix`: an iterator of pages of `(key, size)`, merged from
    /// every server in key order.
    fn enumerate(
        &self,
        py: Python<'_>,
        bucket: &str,
        prefix: &str,
        page_size: u32,
    ) -> PyResult<PyListing> {
        let objects = self.objects.clone();
        let listing = py
            .detach(|| Listing::start(objects, bucket, prefix, page_size))
            .map_err(|f| failure_to_py(py, &f))?;
        Ok(PyListing {
            listing: std::sync::Mutex::new(listing),
        })
    }

    /// LOOKUP each key at its home (no fallbacks), one pipelined round trip per server: per
    /// key `None` where the record is, else the error the server answered.
    fn lookup_homes(
        &self,
        py: Python<'_>,
        bucket: &str,
        keys: Vec<String>,
    ) -> PyResult<Vec<Option<PyErr>>> {
        let objects = &self.objects;
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let outcomes = py.detach(|| objects.lookup_homes(bucket, &key_refs));
        Ok(outcomes
            .iter()
            .map(|o| o.as_ref().err().map(|f| failure_to_py(py, f)))
            .collect())
    }

    /// Block until every key exists or `timeout_s` passes (the GIL released); the keys still
    /// missing, in the order given (`Client.wait_for`; see `waits.rs`).
    fn wait_for(
        &self,
        py: Python<'_>,
        bucket: &str,
        keys: Vec<String>,
        timeout_s: f64,
    ) -> PyResult<Vec<String>> {
        if !(timeout_s.is_finite() && timeout_s >= 0.0) {
            let error = ClientError::InvalidArgument(format!(
                "timeout_s must be finite and >= 0, got {timeout_s}"
            ));
            return Err(to_py_err(py, &error, ""));
        }
        let timeout = std::time::Duration::from_secs_f64(timeout_s);
        let objects = &self.objects;
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        // A parked wait may last many seconds: Python's signals are looked at every
        // SIGNAL_CHECK_INTERVAL, so Ctrl-C ends it (the dropped calls cancel their RPCs).
        let interrupted: std::sync::Mutex<Option<PyErr>> = std::sync::Mutex::new(None);
        let asked = || match Python::attach(|py| py.check_signals()) {
            Ok(()) => false,
            Err(error) => {
                *interrupted.lock().expect("never poisoned") = Some(error);
                true
            }
        };
        let stop = Stop {
            asked: &asked,
            interval: SIGNAL_CHECK_INTERVAL,
        };
        let missing = py
            .detach(|| objects.wait_for(bucket, &key_refs, timeout, stop))
            .map_err(|f| failure_to_py(py, &f))?;
        match missing {
            Some(missing) => Ok(missing.into_iter().map(|i| keys[i].clone()).collect()),
            None => Err(interrupted
                .into_inner()
                .expect("never poisoned")
                .expect("a stopped wait was interrupted")),
        }
    }

    /// The bytes of many objects, in the order of `keys`: block 0 of all of them pipelined per
    /// server, then the data blocks of the large ones, a few objects at once. Every object is
    /// read before an error is raised: the first failure in key order. With `each`, nothing is
    /// raised: a key that failed has its exception in the list instead of its bytes.
    #[pyo3(signature = (bucket, keys, *, delete=false, each=false))]
    fn get_many<'py>(
        &self,
        py: Python<'py>,
        bucket: &str,
        keys: Vec<String>,
        delete: bool,
        each: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let objects = &self.objects;
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let records = py.detach(|| objects.fetch_records(bucket, &key_refs, delete));
        let out = PyList::empty(py);
        let mut first_error: Option<Failure> = None;
        let mut large: Vec<(usize, pocketflow_protocol::header::ObjectHeader, Lent)> = Vec::new();
        for (index, record) in records.into_iter().enumerate() {
            match record {
                Ok(record) => match record.header {
                    Some(header) if header.block_count > 0 => {
                        let size = usize::try_from(header.size)
                            .map_err(|_| PyValueError::new_err("object too large"))?;
                        let made = uninit_bytes(py, size)?;
                        large.push((
                            index,
                            header,
                            Lent {
                                ptr: made.as_bytes().as_ptr() as *mut u8,
                                len: size,
                            },
                        ));
                        out.append(made)?;
                    }
                    _ => out.append(PyBytes::new(py, &record.body))?,
                },
                Err(failure) => {
                    if each {
                        out.append(failure_to_py(py, &failure).into_value(py))?;
                    } else {
                        first_error.get_or_insert(failure);
                        out.append(PyBytes::new(py, b""))?;
                    }
                }
            }
        }
        let large_at: Vec<usize> = large.iter().map(|(index, _, _)| *index).collect();
        if !large.is_empty() {
            let key_refs = &key_refs;
            let outcomes = py.detach(move || {
                // SAFETY: each `bytes` is held by `out` and seen by nobody else until we return.
                let mut reads: Vec<(&str, pocketflow_protocol::header::ObjectHeader, &mut [u8])> =
                    large
                        .into_iter()
                        .map(|(index, header, lent)| {
                            (key_refs[index], header, unsafe { lent.into_slice_mut() })
                        })
                        .collect();
                objects.read_objects(bucket, &mut reads, delete)
            });
            for (index, outcome) in large_at.into_iter().zip(outcomes) {
                if let Err(failure) = outcome {
                    if each {
                        out.set_item(index, failure_to_py(py, &failure).into_value(py))?;
                    } else {
                        first_error.get_or_insert(failure);
                    }
                }
            }
        }
        match first_error {
            Some(failure) => Err(failure_to_py(py, &failure)),
            None => Ok(out),
        }
    }

    /// One small operation on the server of block `block` of `key` (see
    /// `Objects::call_placed`): `(server address, status, header fields or None, body)`.
    #[allow(clippy::too_many_arguments)]
    fn call_placed<'py>(
        &self,
        py: Python<'py>,
        op: u8,
        flags: u8,
        bucket: &[u8],
        key: &[u8],
        block: u32,
        header: &[u8],
        value: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let request = request_of(op, flags, bucket, key, header, value)?;
        let objects = &self.objects;
        let (server, reply) = py
            .detach(|| objects.call_placed(request, block))
            .map_err(|f| failure_to_py(py, &f))?;
        let header = header_fields(py, reply.header)?;
        (
            server.as_str(),
            reply.status,
            header,
            PyBytes::new(py, &reply.body),
        )
            .into_pyobject(py)
    }

    /// Many small operations on `bucket`/`key`, pipelined on the server of block `block` of
    /// `key` (see `Objects::run_placed`). `ops` holds `(op, flags, header, value)` tuples (each
    /// value a buffer, read in place and copied once, as `call_placed` does); returns one
    /// `(status, header fields or None, body)` per op, in order.
    fn run_placed<'py>(
        &self,
        py: Python<'py>,
        bucket: &[u8],
        key: &[u8],
        block: u32,
        ops: &Bound<'py, PyList>,
    ) -> PyResult<Bound<'py, PyList>> {
        check_placed_ops(ops.len()).map_err(|e| to_py_err(py, &e, ""))?;
        let mut requests = Vec::with_capacity(ops.len());
        for item in ops.iter() {
            let (op, flags, header, value): (u8, u8, Bound<'py, PyBytes>, Bound<'py, PyAny>) =
                item.extract()?;
            requests.push(request_of(
                op,
                flags,
                bucket,
                key,
                header.as_bytes(),
                &value,
            )?);
        }
        let objects = &self.objects;
        let replies = py
            .detach(|| objects.run_placed(&requests, block))
            .map_err(|f| failure_to_py(py, &f))?;
        let out = PyList::empty(py);
        for (_, reply) in &replies {
            out.append(reply_tuple(py, reply)?)?;
        }
        Ok(out)
    }

    /// Block 0 of an object where it lives (see `Objects::fetch_record`): `(server address,
    /// header fields or None, body)`.
    #[pyo3(signature = (bucket, key, op, flags, *, lost_unavailable=true))]
    fn fetch_record<'py>(
        &self,
        py: Python<'py>,
        bucket: &str,
        key: &str,
        op: u8,
        flags: u8,
        lost_unavailable: bool,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let op = OpCode::from_code(op).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let objects = &self.objects;
        let record = py
            .detach(|| objects.fetch_record(bucket, key, op, flags, lost_unavailable))
            .map_err(|f| failure_to_py(py, &f))?;
        let header = header_fields(py, record.header)?;
        (
            record.server.as_str(),
            header,
            PyBytes::new(py, &record.body),
        )
            .into_pyobject(py)
    }

    /// Read bytes `[start, end)` of a large object (its header as the 32 bytes of
    /// `ObjectHeader.encode`) from its data blocks: into `dest` (returns the count) or, without
    /// one, into a new `bytes` of exactly `end - start` bytes (returned).
    #[pyo3(signature = (bucket, key, header, start, end, *, delete, dest=None))]
    #[allow(clippy::too_many_arguments)]
    fn read_blocks<'py>(
        &self,
        py: Python<'py>,
        bucket: &str,
        key: &str,
        header: &[u8],
        start: u64,
        end: u64,
        delete: bool,
        dest: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let header = header_of(header)?;
        let count = usize::try_from(end.saturating_sub(start))
            .map_err(|_| PyValueError::new_err("range too large"))?;
        let objects = &self.objects;
        match dest {
            Some(dest) => {
                let (memory, _held) = writable(dest)?;
                if memory.len < count {
                    return Err(PyValueError::new_err(format!(
                        "destination of {} bytes for {count} bytes",
                        memory.len
                    )));
                }
                py.detach(move || {
                    // SAFETY: `_held` keeps the buffer exported until this call returns.
                    let memory = unsafe { &mut memory.slice_mut()[..count] };
                    objects.read_blocks(bucket, key, &header, start, end, delete, memory)
                })
                .map_err(|f| failure_to_py(py, &f))?;
                Ok(count.into_pyobject(py)?.into_any())
            }
            None => {
                let made = uninit_bytes(py, count)?;
                let memory = Lent {
                    ptr: made.as_bytes().as_ptr() as *mut u8,
                    len: count,
                };
                py.detach(move || {
                    // SAFETY: `made` is held and seen by nobody else until the read ends.
                    let memory = unsafe { memory.slice_mut() };
                    objects.read_blocks(bucket, key, &header, start, end, delete, memory)
                })
                .map_err(|f| failure_to_py(py, &f))?;
                Ok(made.into_any())
            }
        }
    }

    /// Put back a record claimed by a DELETE read that could not be delivered (its header as
    /// 32 bytes, and a small object's body); raises why it could not.
    fn restore_record(
        &self,
        py: Python<'_>,
        server: &str,
        bucket: &str,
        key: &str,
        header: &[u8],
        body: &[u8],
    ) -> PyResult<()> {
        let record = pocketflow_client::Record {
            server: server.to_string(),
            header: Some(header_of(header)?),
            body: Bytes::copy_from_slice(body),
        };
        let objects = &self.objects;
        py.detach(|| objects.restore_record(&record, bucket, key))
            .map_err(|e| to_py_err(py, &e, server))
    }

    /// `(size, persist)` of an object. With `lost_unavailable` false, a key that may have been
    /// on a lost server is "not found" instead of "unavailable".
    #[pyo3(signature = (bucket, key, *, lost_unavailable=true))]
    fn lookup(
        &self,
        py: Python<'_>,
        bucket: &str,
        key: &str,
        lost_unavailable: bool,
    ) -> PyResult<(u64, bool)> {
        let objects = &self.objects;
        let record = py
            .detach(|| objects.fetch_record(bucket, key, OpCode::Lookup, 0, lost_unavailable))
            .map_err(|f| failure_to_py(py, &f))?;
        let header = record.header.ok_or_else(|| {
            to_py_err(
                py,
                &ClientError::Protocol("lookup reply without a header".into()),
                &record.server,
            )
        })?;
        Ok((header.size, header.persist()))
    }
}

/// A block of a streamed upload: the caller's buffer, held (exported) until it is sent.
struct HeldBlock(PyBuffer<u8>);

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
#[pyclass(name = "Upload", module = "pocketflow._core", frozen)]
struct PyUpload {
    upload: std::sync::Mutex<StreamUpload<HeldBlock>>,
}

impl PyUpload {
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
        self.locked().version()
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

/// A listing in progress: iterate for its pages.
#[pyclass(name = "Listing", module = "pocketflow._core", frozen)]
struct PyListing {
    listing: std::sync::Mutex<Listing>,
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

/// A destination to fill: a writable C-contiguous buffer, or a fresh `bytes` object.
fn writable(dest: &Bound<'_, PyAny>) -> PyResult<(Lent, Option<PyBuffer<u8>>)> {
    if let Ok(bytes) = dest.cast::<PyBytes>() {
        let data = bytes.as_bytes();
        return Ok((
            Lent {
                ptr: data.as_ptr() as *mut u8,
                len: data.len(),
            },
            None,
        ));
    }
    let buffer = PyBuffer::<u8>::get(dest)?;
    if buffer.readonly() {
        return Err(PyValueError::new_err("the destination buffer is read-only"));
    }
    let lent = readable(&buffer)?;
    Ok((lent, Some(buffer)))
}

/// A new `bytes` object of `size` zero bytes, for `Connection.get_ranges` to fill before
/// anything else sees it: the object a get returns, allocated once at its final size.
#[pyfunction]
fn empty_bytes(py: Python<'_>, size: usize) -> PyResult<Bound<'_, PyBytes>> {
    PyBytes::new_with(py, size, |_| Ok(()))
}

/// Keep freed megabyte-sized buffers in the process (unless `POCKETFLOW_MALLOC_TUNING=0`).
/// Every DoPut and DoGet piece is a buffer of up to `BATCH_MAX_BYTES`; with glibc's defaults each
/// one is mapped and unmapped again, and the kernel zeroes its pages on every reuse: a 1 MiB put
/// took 2.7 ms instead of 1.7 ms. Buffers up to 32 MiB then come from the heap, and up to
/// 128 MiB of free heap top is kept. This is process-wide, hence the switch.
fn keep_transfer_buffers() {
    const MMAP_THRESHOLD_BYTES: libc::c_int = 32 << 20;
    const TRIM_THRESHOLD_BYTES: libc::c_int = 128 << 20;
    if std::env::var_os("POCKETFLOW_MALLOC_TUNING").is_some_and(|v| v == "0") {
        return;
    }
    // SAFETY: mallopt only changes allocator parameters, under glibc's own lock.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES);
    }
}

/// The native client core of pocketflow.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    keep_transfer_buffers();
    m.add_class::<PyConnection>()?;
    m.add_class::<PyPlacement>()?;
    m.add_class::<PyObjects>()?;
    m.add_class::<PyListing>()?;
    m.add_class::<PyUpload>()?;
    m.add_function(wrap_pyfunction!(empty_bytes, m)?)?;
    m.add("PLACED_OPS_MAX", PLACED_OPS_MAX)?;
    Ok(())
}
