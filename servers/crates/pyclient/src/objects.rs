//! `Objects`: the object layer of one job's client, the calls of `pocketflow.client.Client`.

use std::sync::Arc;

use bytes::Bytes;

use pocketflow_client::channels::check_placed_ops;
use pocketflow_client::shared::SharedRead;
use pocketflow_client::waits::Stop;
use pocketflow_client::{
    ClientError, Failure, Layout, Listing, Objects, PutItem, Record, StreamUpload, Tuning,
};
use pocketflow_protocol::frame::OpCode;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::connection::PyConnection;
use crate::convert::{
    connection_config, header_fields, header_of, record_of, reply_tuple, request_of,
};
use crate::errors::{failure_to_py, to_py_err};
use crate::listing::PyListing;
use crate::memory::{readable, uninit_bytes, writable, CallerBuffer, Lent, NewBytes};
use crate::shared::PySharedView;
use crate::upload::PyUpload;
use crate::SIGNAL_CHECK_INTERVAL;

/// The object layer of one job's client (`pocketflow_client::Objects`): the job's current
/// weight map, its connections, and the read path of objects.
#[pyclass(name = "Objects", module = "pocketflow._core", frozen)]
pub(crate) struct PyObjects {
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
        // A `bytes` cannot change: the core sends it as it is (shared, no copy of its own). Any
        // other buffer stays exported while the call runs and is copied once by the core.
        let mut shared: Vec<Option<Bytes>> = Vec::with_capacity(items.len());
        let mut held: Vec<Option<PyBuffer<u8>>> = Vec::with_capacity(items.len());
        for (_, data) in &items {
            match data.cast::<PyBytes>() {
                Ok(bytes) => {
                    shared.push(Some(Bytes::from_owner(PyBackedBytes::from(bytes.clone()))));
                    held.push(None);
                }
                Err(_) => {
                    shared.push(None);
                    held.push(Some(PyBuffer::<u8>::get(data)?));
                }
            }
        }
        let mut lent = Vec::with_capacity(held.len());
        for buffer in &held {
            lent.push(buffer.as_ref().map(readable).transpose()?);
        }
        let keys: Vec<&str> = items.iter().map(|(key, _)| key.as_str()).collect();
        let objects = &self.objects;
        // Borrowed, not moved: the shared values are dropped below, with the GIL held.
        let (keys_ref, shared_ref) = (&keys, &shared);
        let outcome = py.detach(move || {
            let values: Vec<PutItem<'_>> = keys_ref
                .iter()
                .zip(shared_ref)
                .zip(&lent)
                .map(|((&key, shared), memory)| match (shared, memory) {
                    (Some(bytes), _) => (key, bytes.as_ref(), Some(bytes)),
                    // SAFETY: `held` keeps every buffer exported until this call returns.
                    (None, Some(memory)) => (key, unsafe { memory.slice() }, None),
                    (None, None) => unreachable!("every item is shared or held"),
                })
                .collect();
            objects.put_many_shared(bucket, &values, persist, overwrite)
        });
        drop(shared);
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

    /// A streamed upload of `bucket/key`: add its data blocks as they come, then commit.
    #[pyo3(signature = (bucket, key, *, persist))]
    fn upload(&self, py: Python<'_>, bucket: &str, key: &str, persist: bool) -> PyResult<PyUpload> {
        let upload = StreamUpload::new(self.objects.clone(), bucket, key, persist)
            .map_err(|failure| failure_to_py(py, &failure))?;
        Ok(PyUpload::new(upload))
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
        let mut large: Vec<(usize, Layout, Lent)> = Vec::new();
        // A DELETE read's striped objects: their records, taken once their blocks are read.
        let mut striped: Vec<(usize, Record)> = Vec::new();
        // A DELETE read's objects of one data block: read again by a READ each, which claims
        // the record with its block in one exchange (no delete and block-delete actions).
        let mut single: Vec<usize> = Vec::new();
        for (index, record) in records.into_iter().enumerate() {
            match record {
                Ok(record) => match record.header {
                    Some(header) if delete && header.block_count == 1 => {
                        single.push(index);
                        out.append(py.None())?;
                    }
                    Some(header) if header.block_count > 0 => {
                        if delete {
                            striped.push((index, record.clone()));
                        }
                        let size = usize::try_from(header.size)
                            .map_err(|_| PyValueError::new_err("object too large"))?;
                        let layout = Layout::of_record(header, &record.body)
                            .map_err(|e| to_py_err(py, &e, &record.server))?;
                        let made = uninit_bytes(py, size)?;
                        large.push((
                            index,
                            layout,
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
                let mut reads: Vec<(&str, Layout, &mut [u8])> = large
                    .into_iter()
                    .map(|(index, layout, lent)| {
                        (key_refs[index], layout, unsafe { lent.into_slice_mut() })
                    })
                    .collect();
                objects.read_objects(bucket, &mut reads, false)
            });
            // With `delete` every large object is striped, in the same order: slot `i` of both.
            let mut outcomes = outcomes;
            let read: Vec<usize> = (0..striped.len())
                .filter(|&i| outcomes[i].is_ok())
                .collect();
            let claims: Vec<(&str, &Record)> = read
                .iter()
                .map(|&i| (key_refs[striped[i].0], &striped[i].1))
                .collect();
            let claimed = py.detach(|| objects.claim_records(bucket, &claims));
            // A striped object whose claim was lost (another reader took it) is not this
            // reader's: it gets `not_found` instead of the bytes, as the loser of a small one.
            for (&slot, claim) in read.iter().zip(claimed) {
                match claim {
                    Ok(None) => {}
                    Ok(Some(lost)) | Err(lost) => outcomes[slot] = Err(lost),
                }
            }
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
        if !single.is_empty() {
            let single_keys: Vec<&str> = single.iter().map(|&index| key_refs[index]).collect();
            let outcomes =
                py.detach(|| objects.get_each(bucket, &single_keys, true, NewBytes::default));
            for (index, outcome) in single.into_iter().zip(outcomes) {
                match outcome {
                    Ok(mut dest) => {
                        let made = dest.made.take().expect("a read allocated its bytes");
                        out.set_item(index, made.into_bound(py))?;
                    }
                    Err(failure) if each => {
                        out.set_item(index, failure_to_py(py, &failure).into_value(py))?;
                    }
                    Err(failure) => {
                        first_error.get_or_insert(failure);
                        out.set_item(index, PyBytes::new(py, b""))?;
                    }
                }
            }
        }
        match first_error {
            Some(failure) => Err(failure_to_py(py, &failure)),
            None => Ok(out),
        }
    }

    /// Pin `keys` of `bucket` in the shared arenas of this host's servers and read them in
    /// place: per key a `SharedView` (its bytes, pinned until it goes), a small object's `bytes`
    /// (which came with the reply), or None: not pinned, the caller reads it as usual.
    fn pin_views<'py>(
        &self,
        py: Python<'py>,
        bucket: &str,
        keys: Vec<String>,
    ) -> PyResult<Bound<'py, PyList>> {
        let objects = &self.objects;
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let reads = py.detach(|| objects.pin_many(bucket, &key_refs));
        let out = PyList::empty(py);
        for read in reads {
            match read {
                SharedRead::Pinned(pinned) => {
                    out.append(Bound::new(py, PySharedView::new(pinned))?)?
                }
                SharedRead::Value(value) => out.append(PyBytes::new(py, &value))?,
                SharedRead::Copy => out.append(py.None())?,
            }
        }
        Ok(out)
    }

    /// Counts of this client's zero-copy reads: (pinned, values, copied).
    fn shared_counts(&self) -> (u64, u64, u64) {
        let counts = &self.objects.shared.counts;
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        (
            load(&counts.pinned),
            load(&counts.values),
            load(&counts.copied),
        )
    }

    /// Read many objects into one writable buffer: object `i` into
    /// `buffer[offsets[i] .. offsets[i] + sizes[i]]` (the ranges inside the buffer and apart).
    /// Block 0 of all of them pipelined per server, then the data blocks of the large ones, a
    /// few objects at once, straight into their ranges: a reader that keeps its objects in
    /// one buffer (mapped with huge pages) faults its memory in 2 MiB at a time instead of 4 KiB
    /// per `bytes`. Returns, per key, None once its range holds the object, or the exception
    /// it met (`InvalidRequest` when the object is not `sizes[i]` bytes: its range is left).
    fn get_many_into<'py>(
        &self,
        py: Python<'py>,
        bucket: &str,
        keys: Vec<String>,
        buffer: &Bound<'_, PyAny>,
        offsets: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Bound<'py, PyList>> {
        if offsets.len() != keys.len() || sizes.len() != keys.len() {
            return Err(PyValueError::new_err(
                "keys, offsets and sizes must have one entry per key",
            ));
        }
        let (memory, _held) = writable(buffer)?;
        let mut ranges: Vec<(usize, usize)> = Vec::with_capacity(keys.len());
        for (&offset, &size) in offsets.iter().zip(&sizes) {
            let end = offset
                .checked_add(size)
                .filter(|&end| end <= memory.len)
                .ok_or_else(|| PyValueError::new_err("a range lies outside the buffer"))?;
            ranges.push((offset, end));
        }
        ranges.sort_unstable();
        if ranges.windows(2).any(|pair| pair[0].1 > pair[1].0) {
            return Err(PyValueError::new_err("the ranges overlap"));
        }
        let objects = &self.objects;
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let records = py.detach(|| objects.fetch_records(bucket, &key_refs, false));
        let mut outcomes: Vec<Option<Failure>> = Vec::with_capacity(keys.len());
        let mut small: Vec<(usize, Bytes)> = Vec::new();
        let mut large: Vec<(usize, Layout)> = Vec::new();
        for (index, record) in records.into_iter().enumerate() {
            let record = match record {
                Ok(record) => record,
                Err(failure) => {
                    outcomes.push(Some(failure));
                    continue;
                }
            };
            let size = match record.header {
                Some(header) if header.block_count > 0 => header.size,
                _ => record.body.len() as u64,
            };
            if size != sizes[index] as u64 {
                let error = ClientError::InvalidArgument(format!(
                    "{} is {size} bytes, not {}",
                    key_refs[index], sizes[index]
                ));
                outcomes.push(Some(Failure {
                    error,
                    server: record.server,
                }));
                continue;
            }
            match record.header {
                Some(header) if header.block_count > 0 => {
                    let layout = Layout::of_record(header, &record.body)
                        .map_err(|e| to_py_err(py, &e, &record.server))?;
                    large.push((index, layout));
                }
                _ => small.push((index, record.body)),
            }
            outcomes.push(None);
        }
        // An address, not a pointer, to cross into the GIL-free closure.
        let base = memory.ptr as usize;
        let read = py.detach(|| {
            // SAFETY: `_held` keeps the buffer exported until this call returns; the ranges
            // were checked to lie inside it and apart, so each slice is written by one reader.
            let slice_of = |index: usize| unsafe {
                std::slice::from_raw_parts_mut((base as *mut u8).add(offsets[index]), sizes[index])
            };
            for (index, body) in &small {
                slice_of(*index).copy_from_slice(body);
            }
            let mut reads: Vec<(&str, Layout, &mut [u8])> = large
                .iter()
                .map(|(index, layout)| (key_refs[*index], layout.clone(), slice_of(*index)))
                .collect();
            objects.read_objects(bucket, &mut reads, false)
        });
        for ((index, _), outcome) in large.iter().zip(read) {
            if let Err(failure) = outcome {
                outcomes[*index] = Some(failure);
            }
        }
        let out = PyList::empty(py);
        for outcome in outcomes {
            match outcome {
                None => out.append(py.None())?,
                Some(failure) => out.append(failure_to_py(py, &failure).into_value(py))?,
            }
        }
        Ok(out)
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
    /// `ObjectHeader.encode`, and its manifest's value, which names the servers an overflowed
    /// object's blocks skipped) from its data blocks: into `dest` (returns the count) or,
    /// without one, into a new `bytes` of exactly `end - start` bytes (returned).
    #[pyo3(signature = (bucket, key, header, start, end, *, delete, dest=None, value=b"".as_slice()))]
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
        value: &[u8],
    ) -> PyResult<Bound<'py, PyAny>> {
        let header = header_of(header)?;
        let layout = Layout::of_record(header, value).map_err(|e| to_py_err(py, &e, ""))?;
        let layout = &layout;
        let count = usize::try_from(end.saturating_sub(start))
            .map_err(|_| PyValueError::new_err("range too large"))?;
        let objects = &self.objects;
        match dest {
            Some(dest) => {
                let (mut memory, _held) = writable(dest)?;
                if memory.len < count {
                    return Err(PyValueError::new_err(format!(
                        "destination of {} bytes for {count} bytes",
                        memory.len
                    )));
                }
                py.detach(move || {
                    // SAFETY: `_held` keeps the buffer exported until this call returns.
                    let memory = unsafe { &mut memory.slice_mut()[..count] };
                    objects.read_blocks(bucket, key, layout, start, end, delete, memory)
                })
                .map_err(|f| failure_to_py(py, &f))?;
                Ok(count.into_pyobject(py)?.into_any())
            }
            None => {
                let made = uninit_bytes(py, count)?;
                let mut memory = Lent {
                    ptr: made.as_bytes().as_ptr() as *mut u8,
                    len: count,
                };
                py.detach(move || {
                    // SAFETY: `made` is held and seen by nobody else until the read ends.
                    let memory = unsafe { memory.slice_mut() };
                    objects.read_blocks(bucket, key, layout, start, end, delete, memory)
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
        let record = record_of(server, header, body)?;
        let objects = &self.objects;
        py.detach(|| objects.restore_record(&record, bucket, key))
            .map_err(|e| to_py_err(py, &e, server))
    }

    /// Take the record of a striped object a DELETE read has read whole (its header as 32
    /// bytes, and its manifest's value) and free its blocks; `False` when another reader took
    /// that version first (or an overwrite replaced it), and the bytes are not this reader's.
    fn claim_record(
        &self,
        py: Python<'_>,
        server: &str,
        bucket: &str,
        key: &str,
        header: &[u8],
        body: &[u8],
    ) -> PyResult<bool> {
        let record = record_of(server, header, body)?;
        let objects = &self.objects;
        py.detach(|| objects.claim_record(&record, bucket, key))
            .map(|lost| lost.is_none())
            .map_err(|f| failure_to_py(py, &f))
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
