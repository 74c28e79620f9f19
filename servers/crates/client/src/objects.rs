//! The object layer of one job's client: where an object's block 0 and data blocks live, and
//! how a read finds them. It owns the job's current [`View`] (and adopts the newer map a
//! `stale_epoch` answer carries), one [`Connection`] per server, and the read path of an object:
//! block 0 from its home with the PERSIST and earlier-map fallbacks, then its data blocks from
//! every server at once, with fallbacks for blocks written under an earlier map.
//!
//! Where things go (the same rules as the module doc of `pocketflow/client.py`): block 0 of an
//! object lives on the server placed for `(key, 0)`, PERSIST objects on the long-running servers'
//! placement; data block `i` on the server placed for `(key, i)`, except that the one data block of
//! a one-block object lives with its manifest ([`block_home`]). A read looks for block 0 on the
//! ephemeral placement, then on the PERSIST one, and once the map has changed (epoch > 1) on every
//! other server in rendezvous order, because data never moves when a job is resized. Once the job
//! has lost a server, a key that no live server holds is "unavailable", not "not found".

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use bytes::Bytes;
use pocketflow_protocol::action::ActionName;
use pocketflow_protocol::frame::{OpCode, OP_FLAG_PERSIST};
use pocketflow_protocol::header::ObjectHeader;
use pocketflow_protocol::limits::{BLOCK_SIZE_MAX_BYTES, TICKET_RANGES_MAX};
use pocketflow_protocol::ticket::{BlockRange, GetTicket, ReadTicket};
use tonic::Code;

use crate::blocks::RangeTarget;
use crate::config::ConnectionConfig;
use crate::connection::{Connection, ExchangeReply, ExchangeRequest};
use crate::error::ClientError;
use crate::placement::placed_block;
use crate::view::{stale_weight_map, Server, View};

/// How many times one call adopts a newer weight map and retries (`STALE_EPOCH_RETRIES_MAX`
/// of `pocketflow/layout.py`).
pub const STALE_EPOCH_RETRIES_MAX: usize = 4;
/// Fewest blocks of one object that one read ticket carries: a large object's blocks on one
/// server are read as several tickets in parallel, each at least this many blocks.
pub const READ_TICKET_BLOCKS_MIN: usize = 4;
/// Most threads one read moves blocks on, whatever the configuration says.
pub const IO_THREADS_MAX: usize = 64;
/// `get_many` reads the data blocks of at most this many large objects at once (fewer if
/// `io_threads` is smaller); each one already spreads its blocks over the I/O threads.
pub const LARGE_OBJECTS_IN_FLIGHT_MAX: usize = 4;

/// How a job's client spreads its work.
#[derive(Debug, Clone, Copy)]
pub struct Tuning {
    /// Most threads one object's data blocks move on.
    pub io_threads: usize,
    /// Most small operations in flight per session.
    pub exchange_window: usize,
}

/// A failed object operation: the error and the server it concerns (its address; empty when
/// no server is involved).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// What went wrong.
    pub error: ClientError,
    /// The server's address.
    pub server: String,
}

impl Failure {
    pub(crate) fn at(error: ClientError, server: &str) -> Failure {
        Failure {
            error,
            server: server.to_string(),
        }
    }

    pub(crate) fn local(error: ClientError) -> Failure {
        Failure {
            error,
            server: String::new(),
        }
    }
}

/// A block-0 record as a read found it: where, and the server's reply (status 0).
#[derive(Debug, Clone)]
pub struct Record {
    /// The address of the server that holds it.
    pub server: String,
    /// The object header (absent only in replies that carry none).
    pub header: Option<ObjectHeader>,
    /// A small object's bytes (empty for a large object's manifest).
    pub body: Bytes,
}

impl Record {
    /// The object's size in bytes.
    pub fn size(&self) -> u64 {
        match self.header {
            Some(header) => header.size,
            None => self.body.len() as u64,
        }
    }

    /// Whether the object's bytes are in data blocks rather than in the record.
    pub fn has_blocks(&self) -> bool {
        self.header.is_some_and(|h| h.block_count > 0)
    }
}

/// Where a read puts an object's bytes once it knows their size.
pub trait Destination {
    /// Memory for `size` bytes (exactly `size`, or at least `size` for a caller's buffer), or
    /// an error that ends the read (the object is then put back if the read was a DELETE).
    fn buffer(&mut self, size: usize) -> Result<&mut [u8], ClientError>;

    /// The most bytes [`Destination::buffer`] can give, when it is bounded (a caller's buffer);
    /// `None` when it allocates what the object needs.
    fn room(&self) -> Option<usize> {
        None
    }
}

/// The connections of one process, made on first use; a forked child never uses its parent's.
struct Connections {
    pid: u32,
    closed: bool,
    by_address: HashMap<String, Arc<Connection>>,
}

/// The object layer of one job's client (see the module doc). Thread-safe.
pub struct Objects {
    view: RwLock<Arc<View>>,
    /// Bumped on every change of the view, so a caller can tell cheaply that it changed.
    generation: AtomicU64,
    pub(crate) config: ConnectionConfig,
    pub(crate) io_threads: usize,
    pub(crate) exchange_window: usize,
    connections: Mutex<Connections>,
    /// `(address, bucket)` of the buckets this client created on servers that lacked them.
    pub(crate) repaired_buckets: Mutex<std::collections::HashSet<(String, String)>>,
}

fn kind_of(error: &ClientError) -> &str {
    match error {
        ClientError::Server { message, .. } => message.split_once(": ").map_or("", |(k, _)| k),
        _ => "",
    }
}

pub(crate) fn server_error(code: i32, kind: &str, message: String) -> ClientError {
    ClientError::Server {
        code,
        message: format!("{kind}: {message}"),
    }
}

/// The error a non-zero reply stands for.
pub(crate) fn reply_error(reply: &ExchangeReply) -> ClientError {
    ClientError::Server {
        code: i32::from(reply.status),
        message: String::from_utf8_lossy(&reply.body).into_owned(),
    }
}

/// A reply standing for a session that failed before running the op (a stale opening context).
pub(crate) fn failure_reply(error: &ClientError) -> ExchangeReply {
    ExchangeReply {
        status: u8::try_from(error.code()).unwrap_or(Code::Internal as u8),
        header: None,
        body: Bytes::from(error.to_string()),
    }
}

/// A JSON request body (a ticket, an action's body).
pub(crate) fn body<T: serde::Serialize>(request: &T) -> Bytes {
    Bytes::from(serde_json::to_vec(request).expect("a request serializes"))
}

/// The destination memory of a read shared by the threads that fill it, each its own ranges.
#[derive(Clone, Copy)]
struct SharedDest {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the threads of one read write disjoint ranges of the destination (every range of the
// object appears in exactly one ticket), and the read waits for all of them before returning.
unsafe impl Send for SharedDest {}
unsafe impl Sync for SharedDest {}

impl SharedDest {
    /// The whole destination. SAFETY: the caller writes only its own ranges of it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }
}

/// What one read has received so far, per data block.
type Received = Mutex<HashMap<u32, u64>>;

enum Probe {
    Found(Record),
    Stale(Failure),
    Missing { bucket_seen: bool },
}

impl Objects {
    /// The object layer of the job whose handle is `handle_json` (`JobHandle.to_json`), with
    /// connections made with `config`.
    pub fn new(
        handle_json: &str,
        config: ConnectionConfig,
        tuning: Tuning,
    ) -> Result<Objects, ClientError> {
        let view = View::from_handle_json(handle_json)?;
        Ok(Objects {
            view: RwLock::new(Arc::new(view)),
            generation: AtomicU64::new(0),
            config,
            io_threads: tuning.io_threads.clamp(1, IO_THREADS_MAX),
            exchange_window: tuning.exchange_window.max(1),
            connections: Mutex::new(Connections {
                pid: crate::runtime::process_id(),
                closed: false,
                by_address: HashMap::new(),
            }),
            repaired_buckets: Mutex::new(std::collections::HashSet::new()),
        })
    }

    // -- the view ------------------------------------------------------------------------------

    /// The current view.
    pub fn view(&self) -> Arc<View> {
        self.view
            .read()
            .expect("the view lock is never poisoned")
            .clone()
    }

    /// A number that changes whenever the view does.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Use the handle `handle_json` from now on (a renewed token, a newer map: the caller
    /// decided it supersedes the current one).
    pub fn set_handle(&self, handle_json: &str) -> Result<(), ClientError> {
        let view = View::from_handle_json(handle_json)?;
        let mut outcome = Ok(());
        self.replace_view(|current| {
            if view.epoch >= current.epoch {
                return Some(Arc::new(view));
            }
            // A map older than the one in use (adopted meanwhile from a server's answer) never
            // moves the client back: keep the map, take the rest of the handle (a new token).
            match view.with_weight_map(&current.weight_map()) {
                Ok(kept) => Some(Arc::new(kept)),
                Err(error) => {
                    outcome = Err(error);
                    None
                }
            }
        });
        outcome
    }

    /// Adopt the weight map a `stale_epoch` error carries if it is newer than the current one;
    /// an error that carries none (or an unusable one) is returned as it is.
    pub fn adopt(&self, stale: &ClientError) -> Result<(), ClientError> {
        let map = match stale {
            ClientError::Server { message, .. } => stale_weight_map(message),
            _ => None,
        };
        match map {
            Some(map) => self
                .adopt_weight_map(&map)
                .map(|_| ())
                .map_err(|_| stale.clone()),
            None => Err(stale.clone()),
        }
    }

    /// Adopt `weight_map` (`{"epoch", "servers", "lost"?}`) if its epoch is newer than the
    /// current view's; returns whether it was adopted.
    pub fn adopt_weight_map(
        &self,
        weight_map: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<bool, ClientError> {
        let epoch = weight_map
            .get("epoch")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| ClientError::InvalidArgument("weight map without an epoch".into()))?;
        let mut outcome = Ok(false);
        self.replace_view(|current| {
            if epoch <= current.epoch {
                return None;
            }
            match current.with_weight_map(weight_map) {
                Ok(view) => {
                    outcome = Ok(true);
                    Some(Arc::new(view))
                }
                Err(error) => {
                    outcome = Err(error);
                    None
                }
            }
        });
        outcome
    }

    fn replace_view(&self, make: impl FnOnce(&View) -> Option<Arc<View>>) {
        let mut guard = self.view.write().expect("the view lock is never poisoned");
        if let Some(view) = make(&guard) {
            *guard = view;
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
    }

    // -- connections ---------------------------------------------------------------------------

    /// The connection to `address`, made on first use.
    pub fn connection(&self, address: &str) -> Result<Arc<Connection>, ClientError> {
        let mut connections = self.connections.lock().expect("never poisoned");
        if connections.pid != crate::runtime::process_id() {
            return Err(ClientError::InvalidArgument(
                "this client core was made by the parent of this forked process; \
                 make a new one here"
                    .into(),
            ));
        }
        if connections.closed {
            return Err(ClientError::InvalidArgument("the client is closed".into()));
        }
        if let Some(connection) = connections.by_address.get(address) {
            return Ok(connection.clone());
        }
        let connection = Arc::new(Connection::new(address, self.config.clone())?);
        connections
            .by_address
            .insert(address.to_string(), connection.clone());
        Ok(connection)
    }

    /// Close every connection; with `reopen`, later calls make new ones (else they fail).
    pub fn close(&self, reopen: bool) {
        let taken: Vec<Arc<Connection>> = {
            let mut connections = self.connections.lock().expect("never poisoned");
            if connections.pid != crate::runtime::process_id() {
                return;
            }
            connections.closed |= !reopen;
            connections.by_address.drain().map(|(_, c)| c).collect()
        };
        for connection in taken {
            connection.close();
        }
    }

    fn call(
        &self,
        view: &View,
        server: &str,
        request: ExchangeRequest,
    ) -> Result<ExchangeReply, ClientError> {
        let mut replies = self.exchange(view, server, std::slice::from_ref(&request))?;
        Ok(replies.pop().expect("one reply per request"))
    }

    /// Run `requests` pipelined over one session of the server at `address`, with `view`'s
    /// context.
    pub(crate) fn exchange(
        &self,
        view: &View,
        address: &str,
        requests: &[ExchangeRequest],
    ) -> Result<Vec<ExchangeReply>, ClientError> {
        self.connection(address)?.exchange_blocking(
            &view.exchange_command,
            view.epoch,
            requests,
            self.exchange_window,
        )
    }

    /// Run one action on the server at `address`.
    pub(crate) fn action(
        &self,
        address: &str,
        name: ActionName,
        body: Bytes,
    ) -> Result<Bytes, ClientError> {
        let connection = self.connection(address)?;
        crate::block_on(connection.action(name.as_str(), body))
    }

    fn call_or_stale(
        &self,
        view: &View,
        server: &str,
        request: ExchangeRequest,
    ) -> Result<ExchangeReply, Failure> {
        match self.call(view, server, request) {
            Ok(reply) => Ok(reply),
            // A new session's opening context was stale: the session never ran the op.
            Err(error) if error.is_stale_epoch() => Ok(failure_reply(&error)),
            Err(error) => Err(Failure::at(error, server)),
        }
    }

    pub(crate) fn adopt_or_fail(&self, stale: Failure, attempt: usize) -> Result<(), Failure> {
        if attempt == STALE_EPOCH_RETRIES_MAX {
            return Err(stale);
        }
        self.adopt(&stale.error)
            .map_err(|error| Failure::at(error, &stale.server))
    }

    // -- block 0 -------------------------------------------------------------------------------

    /// Run a GET, LOOKUP or DELETE of block 0 where the object lives (see the module doc).
    ///
    /// A GET or LOOKUP that finds the key on no live server of a job that lost servers fails as
    /// unavailable (unless `lost_unavailable` is false: a waiter keeps waiting for such a key).
    pub fn fetch_record(
        &self,
        bucket: &str,
        key: &str,
        op: OpCode,
        flags: u8,
        lost_unavailable: bool,
    ) -> Result<Record, Failure> {
        let request = record_request(bucket, key, op, flags);
        self.fetch_record_with(&request, lost_unavailable, &mut |view, server| {
            self.call_or_stale(view, &server.address, request.clone())
        })
    }

    /// [`Objects::fetch_record`] of `request`, asking block 0's home with `at_home` (the
    /// fallbacks ask with `request` over a session).
    fn fetch_record_with(
        &self,
        request: &ExchangeRequest,
        lost_unavailable: bool,
        at_home: &mut dyn FnMut(&View, &Server) -> Result<ExchangeReply, Failure>,
    ) -> Result<Record, Failure> {
        let (bucket, key, op) = (request.bucket.as_str(), request.key.as_str(), request.op);
        let key_raw = key.as_bytes();
        for attempt in 0..=STALE_EPOCH_RETRIES_MAX {
            let view = self.view();
            let primary = home(&view, key_raw, 0, false)?;
            let reply = at_home(&view, primary)?;
            if reply.status == 0 {
                return Ok(Record {
                    server: primary.address.clone(),
                    header: reply.header,
                    body: reply.body,
                });
            }
            let error = reply_error(&reply);
            if error.is_stale_epoch() {
                self.adopt_or_fail(Failure::at(error, &primary.address), attempt)?;
                continue;
            }
            if !error.is_not_found() {
                return Err(Failure::at(error, &primary.address));
            }
            match self.probe_fallbacks(&view, primary, key_raw, request)? {
                Probe::Found(record) => return Ok(record),
                Probe::Stale(stale) => {
                    self.adopt_or_fail(stale, attempt)?;
                    continue;
                }
                Probe::Missing { bucket_seen } => {
                    let mut error = error;
                    if kind_of(&error) == "bucket_not_found" && bucket_seen {
                        error = server_error(
                            Code::NotFound as i32,
                            "not_found",
                            format!("{bucket}/{key}"),
                        );
                    }
                    if kind_of(&error) == "not_found" && op != OpCode::Delete && lost_unavailable {
                        if let Some((lost, server)) = view.lost_error(&format!("{bucket}/{key}")) {
                            return Err(Failure {
                                error: lost,
                                server,
                            });
                        }
                    }
                    return Err(Failure::at(error, &primary.address));
                }
            }
        }
        unreachable!("the last attempt returns")
    }

    /// Try block 0 on the PERSIST placement, then (epoch > 1) every other server.
    fn probe_fallbacks(
        &self,
        view: &View,
        primary: &Server,
        key: &[u8],
        request: &ExchangeRequest,
    ) -> Result<Probe, Failure> {
        let mut candidates: Vec<&Server> = Vec::new();
        if view.placement.has_persist() {
            if let Some(persist) = view.server_for(key, 0, true) {
                if persist.node_id != primary.node_id {
                    candidates.push(persist);
                }
            }
        }
        if view.epoch > 1 {
            let first = candidates.first().map(|s| s.node_id.clone());
            candidates
                .extend(view.ranked(key, 0).filter(|s| {
                    s.node_id != primary.node_id && Some(&s.node_id) != first.as_ref()
                }));
        }
        let mut bucket_seen = false;
        for server in candidates {
            let reply = match self.call(view, &server.address, request.clone()) {
                Ok(reply) => reply,
                Err(error) if error.is_stale_epoch() => {
                    return Ok(Probe::Stale(Failure::at(error, &server.address)))
                }
                Err(error) => return Err(Failure::at(error, &server.address)),
            };
            if reply.status == 0 {
                return Ok(Probe::Found(Record {
                    server: server.address.clone(),
                    header: reply.header,
                    body: reply.body,
                }));
            }
            let error = reply_error(&reply);
            if error.is_stale_epoch() {
                return Ok(Probe::Stale(Failure::at(error, &server.address)));
            }
            match kind_of(&error) {
                "not_found" => bucket_seen = true,
                "bucket_not_found" => {}
                _ => return Err(Failure::at(error, &server.address)),
            }
        }
        Ok(Probe::Missing { bucket_seen })
    }

    /// Put back a record claimed by a DELETE read whose bytes could not be delivered; returns
    /// why it could not be put back, if it could not.
    pub fn restore_record(
        &self,
        record: &Record,
        bucket: &str,
        key: &str,
    ) -> Result<(), ClientError> {
        let Some(header) = record.header else {
            return Ok(());
        };
        let view = self.view();
        let request = ExchangeRequest {
            op: OpCode::Put,
            flags: if header.persist() { OP_FLAG_PERSIST } else { 0 },
            bucket: bucket.to_string(),
            key: key.to_string(),
            header,
            value: if header.block_count == 0 {
                record.body.clone()
            } else {
                Bytes::new()
            },
        };
        let reply = self.call(&view, &record.server, request)?;
        if reply.status == 0 {
            Ok(())
        } else {
            Err(reply_error(&reply))
        }
    }

    // -- whole reads ---------------------------------------------------------------------------

    /// Read the object into the memory `dest` gives for its size; returns the size. With
    /// `delete` the object is removed as it is read (exactly one of concurrent DELETE readers
    /// gets it). If `dest` refuses the size, a DELETE read puts the object back first.
    pub fn get(
        &self,
        bucket: &str,
        key: &str,
        delete: bool,
        dest: &mut dyn Destination,
    ) -> Result<usize, Failure> {
        let flags = if delete {
            pocketflow_protocol::frame::OP_FLAG_DELETE
        } else {
            0
        };
        let request = record_request(bucket, key, OpCode::Get, flags);
        let mut delivered = None;
        let record = self.fetch_record_with(&request, true, &mut |view, server| {
            let read = self.read_at_home(view, server, &request, &mut *dest)?;
            if let Some(size) = read.1 {
                delivered = Some(size);
            }
            Ok(read.0)
        })?;
        if let Some(size) = delivered {
            return Ok(size);
        }
        let size = usize::try_from(record.size()).map_err(|_| {
            Failure::local(ClientError::InvalidArgument(format!(
                "an object of {} bytes does not fit this process's memory",
                record.size()
            )))
        })?;
        let buffer = match dest.buffer(size) {
            Ok(buffer) => buffer,
            Err(error) => {
                let error = if delete {
                    match self.restore_record(&record, bucket, key) {
                        Ok(()) => error,
                        Err(why) => ClientError::InvalidArgument(format!(
                            "{}; the object could not be put back: {why}",
                            error.to_string().trim_start_matches("invalid_argument: ")
                        )),
                    }
                } else {
                    error
                };
                return Err(Failure::local(error));
            }
        };
        self.fill(bucket, key, &record, 0, delete, &mut buffer[..size])?;
        Ok(size)
    }

    /// Ask block 0's home for the record of a GET `request` with a direct READ, which brings a
    /// small object's value, or the data block of an object of one data block, along into
    /// `dest`; returns the record's reply and, when the whole object is in `dest`, its size.
    /// Over Flight, or from a server without READ, the record comes over a session alone.
    fn read_at_home(
        &self,
        view: &View,
        server: &Server,
        request: &ExchangeRequest,
        dest: &mut dyn Destination,
    ) -> Result<(ExchangeReply, Option<usize>), Failure> {
        let connection = self
            .connection(&server.address)
            .map_err(|e| Failure::at(e, &server.address))?;
        let room = dest.room().map_or(u64::MAX, |room| room as u64);
        let ticket = body(&ReadTicket {
            ctx: view.ctx.clone(),
            bucket: request.bucket.clone(),
            key: request.key.clone(),
            delete: request.flags & pocketflow_protocol::frame::OP_FLAG_DELETE != 0,
            inline_bytes_max: room.min(u64::from(BLOCK_SIZE_MAX_BYTES)),
        });
        let read = match connection.read_object_blocking(&ticket, dest) {
            Ok(Some(read)) => read,
            Ok(None) => {
                let reply = self.call_or_stale(view, &server.address, request.clone())?;
                return Ok((reply, None));
            }
            // The ticket's context was refused before the record was looked at.
            Err(error) if error.is_stale_epoch() => return Ok((failure_reply(&error), None)),
            Err(error) => return Err(Failure::at(error, &server.address)),
        };
        if let Some(error) = read.error {
            // A small object's value the destination refused is the reply's body: the caller
            // asks the destination again and, for a DELETE read, puts the object back.
            let small = read.reply.header.filter(|h| h.block_count == 0);
            if read.received == 0 && small.is_some_and(|h| read.reply.body.len() as u64 == h.size) {
                return Ok((read.reply, None));
            }
            return Err(Failure::at(error, &server.address));
        }
        let whole = match read.reply.header {
            Some(header) if read.reply.status == 0 && read.received > 0 => {
                if read.received != header.size {
                    return Err(Failure::at(
                        ClientError::Protocol(format!(
                            "a READ brought {} of {} bytes",
                            read.received, header.size
                        )),
                        &server.address,
                    ));
                }
                Some(header.size as usize)
            }
            // An empty small object is whole with no byte.
            Some(header)
                if read.reply.status == 0 && header.block_count == 0 && header.size == 0 =>
            {
                Some(dest.buffer(0).map(|_| 0).map_err(Failure::local)?)
            }
            Some(header) if read.reply.status == 0 && header.block_count == 0 => {
                return Err(Failure::at(
                    ClientError::Protocol("a READ's small object came without its bytes".into()),
                    &server.address,
                ));
            }
            _ => None,
        };
        Ok((read.reply, whole))
    }

    /// Bytes `[offset, offset + length)` of the object, cut at its end, into the memory `dest`
    /// gives for their count; returns the count.
    pub fn get_range(
        &self,
        bucket: &str,
        key: &str,
        offset: u64,
        length: u64,
        dest: &mut dyn Destination,
    ) -> Result<usize, Failure> {
        let record = self.fetch_record(bucket, key, OpCode::Get, 0, true)?;
        let size = record.size();
        let end = size.min(offset.saturating_add(length));
        let count = end.saturating_sub(offset) as usize;
        let buffer = dest.buffer(count).map_err(Failure::local)?;
        if count > 0 {
            self.fill(bucket, key, &record, offset, false, &mut buffer[..count])?;
        }
        Ok(count)
    }

    /// Run `op` on block 0 of every key at its home (no fallbacks), pipelined over one session
    /// per server, all servers at once, adopting newer maps; each key's outcome in order, "not
    /// found" answers included as they came.
    fn on_homes(
        &self,
        bucket: &str,
        keys: &[&str],
        op: OpCode,
        flags: u8,
    ) -> Vec<Result<Record, Failure>> {
        let mut results: Vec<Option<Result<Record, Failure>>> = vec![None; keys.len()];
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        for attempt in 0..=STALE_EPOCH_RETRIES_MAX {
            let view = self.view();
            let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
            for &index in &pending {
                match home(&view, keys[index].as_bytes(), 0, false) {
                    Ok(server) => push_grouped(&mut groups, &server.address, index),
                    Err(failure) => results[index] = Some(Err(failure)),
                }
            }
            let outcomes = run_parallel(
                &groups.iter().collect::<Vec<_>>(),
                groups.len(),
                |(address, group)| {
                    let requests: Vec<ExchangeRequest> = group
                        .iter()
                        .map(|&index| ExchangeRequest {
                            op,
                            flags,
                            bucket: bucket.to_string(),
                            key: keys[index].to_string(),
                            header: ObjectHeader::default(),
                            value: Bytes::new(),
                        })
                        .collect();
                    self.exchange(&view, address, &requests)
                },
            );
            let mut retry = Vec::new();
            let mut stale: Option<Failure> = None;
            for ((address, group), outcome) in groups.iter().zip(outcomes) {
                // A session that failed before its replies came fails each of its ops alike.
                let replies = match outcome {
                    Ok(replies) => replies,
                    Err(error) => vec![failure_reply(&error); group.len()],
                };
                for (&index, reply) in group.iter().zip(replies) {
                    if reply.status == 0 {
                        results[index] = Some(Ok(Record {
                            server: address.to_string(),
                            header: reply.header,
                            body: reply.body,
                        }));
                        continue;
                    }
                    let error = reply_error(&reply);
                    if error.is_stale_epoch() && attempt < STALE_EPOCH_RETRIES_MAX {
                        stale = Some(Failure::at(error, address));
                        retry.push(index);
                    } else {
                        results[index] = Some(Err(Failure::at(error, address)));
                    }
                }
            }
            if let Some(stale) = stale {
                if let Err(failure) = self.adopt_or_fail(stale, attempt) {
                    for index in retry.drain(..) {
                        results[index] = Some(Err(failure.clone()));
                    }
                }
            }
            pending = retry;
            if pending.is_empty() {
                break;
            }
        }
        results
            .into_iter()
            .map(|r| r.expect("every key has an outcome"))
            .collect()
    }

    /// Block 0 of many objects, in the order of `keys`: pipelined over one session per server,
    /// all servers at once; a key missing from its home is then looked for like
    /// [`Objects::fetch_record`] does, one key at a time. With `delete` each record found is
    /// claimed (its data blocks are freed as they are read).
    pub fn fetch_records(
        &self,
        bucket: &str,
        keys: &[&str],
        delete: bool,
    ) -> Vec<Result<Record, Failure>> {
        let flags = if delete {
            pocketflow_protocol::frame::OP_FLAG_DELETE
        } else {
            0
        };
        let mut results = self.on_homes(bucket, keys, OpCode::Get, flags);
        // Fallback placements (PERSIST, earlier maps) are probed one key at a time.
        for (index, result) in results.iter_mut().enumerate() {
            if matches!(result, Err(failure) if failure.error.is_not_found()) {
                *result = self.fetch_record(bucket, keys[index], OpCode::Get, flags, true);
            }
        }
        results
    }

    /// Whether each key's record is at its home (a LOOKUP there, no fallbacks): `Ok` where it
    /// is, else the answer (`not_found`, `bucket_not_found`, ...). One pipelined round trip per
    /// server: what a waiter checks before parking.
    pub fn lookup_homes(&self, bucket: &str, keys: &[&str]) -> Vec<Result<(), Failure>> {
        self.on_homes(bucket, keys, OpCode::Lookup, 0)
            .into_iter()
            .map(|r| r.map(|_| ()))
            .collect()
    }

    /// Read the data blocks of many large objects, each into its own destination, at most
    /// `LARGE_OBJECTS_IN_FLIGHT_MAX` objects at once; returns each read's outcome in order.
    pub fn read_objects(
        &self,
        bucket: &str,
        reads: &mut [(&str, ObjectHeader, &mut [u8])],
        delete: bool,
    ) -> Vec<Result<(), Failure>> {
        let objects_at_once = LARGE_OBJECTS_IN_FLIGHT_MAX.min(self.io_threads).max(1);
        let shared: Vec<(&str, ObjectHeader, SharedDest)> = reads
            .iter_mut()
            .map(|(key, header, dest)| {
                (
                    *key,
                    *header,
                    SharedDest {
                        ptr: dest.as_mut_ptr(),
                        len: dest.len(),
                    },
                )
            })
            .collect();
        run_parallel(&shared, objects_at_once, |(key, header, dest)| {
            // SAFETY: each read has a destination of its own, written by this task only.
            let dest = unsafe { dest.slice() };
            self.read_blocks(bucket, key, &header, 0, header.size, delete, dest)
        })
    }

    // -- data blocks ---------------------------------------------------------------------------

    /// Fill `dest` with the object's bytes from `start` on: from the record of a small object,
    /// else from the data blocks its manifest names.
    fn fill(
        &self,
        bucket: &str,
        key: &str,
        record: &Record,
        start: u64,
        delete: bool,
        dest: &mut [u8],
    ) -> Result<(), Failure> {
        let end = start + dest.len() as u64;
        match record.header {
            Some(header) if header.block_count > 0 => {
                self.read_blocks(bucket, key, &header, start, end, delete, dest)
            }
            _ => {
                dest.copy_from_slice(&record.body[start as usize..end as usize]);
                Ok(())
            }
        }
    }

    /// Read object bytes `[start, end)` of a large object from its data blocks into `dest`
    /// (`end - start` bytes). Each server's blocks go as tickets of at least
    /// `READ_TICKET_BLOCKS_MIN` blocks, read in parallel on up to `io_threads` threads.
    #[allow(clippy::too_many_arguments)]
    pub fn read_blocks(
        &self,
        bucket: &str,
        key: &str,
        header: &ObjectHeader,
        start: u64,
        end: u64,
        delete: bool,
        dest: &mut [u8],
    ) -> Result<(), Failure> {
        let view = self.view();
        let block_size = u64::from(header.block_size);
        if block_size == 0 || start >= end || end > header.size {
            return Err(Failure::local(ClientError::Protocol(format!(
                "manifest of {bucket}/{key} cannot hold bytes {start}..{end}"
            ))));
        }
        let expected = end - start;
        if dest.len() as u64 != expected {
            return Err(Failure::local(ClientError::InvalidArgument(format!(
                "destination of {} bytes for {expected} bytes",
                dest.len()
            ))));
        }
        let first = (start / block_size + 1) as u32;
        let last = ((end - 1) / block_size + 1) as u32;
        let mut groups: Vec<(&str, Vec<RangeTarget>)> = Vec::new();
        for index in first..=last {
            let block_start = u64::from(index - 1) * block_size;
            let low = start.max(block_start);
            let high = end.min(block_start + block_size).min(header.size);
            let server = block_home(
                &view,
                key.as_bytes(),
                index,
                header.block_count,
                header.persist(),
            )?;
            let range = RangeTarget {
                block: index,
                offset: low - block_start,
                len: high - low,
                dest_at: (low - start) as usize,
            };
            push_grouped(&mut groups, &server.address, range);
        }
        let blocks = (last - first + 1) as usize;
        let per_ticket = READ_TICKET_BLOCKS_MIN
            .max(blocks.div_ceil(self.io_threads))
            .min(TICKET_RANGES_MAX);
        let tasks: Vec<(&str, &[RangeTarget])> = groups
            .iter()
            .flat_map(|(address, ranges)| {
                ranges
                    .chunks(per_ticket)
                    .map(move |chunk| (*address, chunk))
            })
            .collect();
        let received: Received = Mutex::new(HashMap::new());
        let shared = SharedDest {
            ptr: dest.as_mut_ptr(),
            len: dest.len(),
        };
        let fetch = |(address, chunk): (&str, &[RangeTarget])| -> Result<(), Failure> {
            let read = ReadOf {
                objects: self,
                bucket,
                key,
                version: header.version,
                block_count: header.block_count,
                delete,
                shared,
                received: &received,
            };
            match read.ranges_current(address, chunk) {
                Err(failure) if failure.error.is_not_found() && view.epoch > 1 => {
                    read.moved_blocks(&view, address, chunk)
                }
                other => other,
            }
        };
        let outcomes = run_parallel(&tasks, self.io_threads, fetch);
        if let Some(failure) = outcomes.into_iter().find_map(Result::err) {
            return Err(failure);
        }
        let got: u64 = received.lock().expect("never poisoned").values().sum();
        if got != expected {
            return Err(Failure::local(ClientError::Protocol(format!(
                "read {got} bytes of {key:?}, expected {expected}"
            ))));
        }
        Ok(())
    }
}

/// The exchange request of a block-0 op of `key` (GET, LOOKUP, DELETE) with `flags`.
fn record_request(bucket: &str, key: &str, op: OpCode, flags: u8) -> ExchangeRequest {
    ExchangeRequest {
        op,
        flags,
        bucket: bucket.to_string(),
        key: key.to_string(),
        header: ObjectHeader::default(),
        value: Bytes::new(),
    }
}

/// The home of block `block` of `key`, or the typed reason there is none.
pub(crate) fn home<'v>(
    view: &'v View,
    key: &[u8],
    block: u32,
    persist: bool,
) -> Result<&'v Server, Failure> {
    view.server_for(key, block, persist).ok_or_else(|| {
        let error = if persist {
            server_error(
                Code::FailedPrecondition as i32,
                "persist_refused",
                "the job's weight map has no long-running server".into(),
            )
        } else {
            ClientError::Unavailable("the job's weight map has no server with weight > 0".into())
        };
        Failure::local(error)
    })
}

/// The home of data block `block` of an object of `block_count` data blocks (any count above
/// one for a streamed upload that knows no more): where placement puts
/// `(key, placed_block(block, block_count))`, so an object of one data block lives whole on its
/// manifest's home. Every path that writes, reads or frees a data block asks this.
pub(crate) fn block_home<'v>(
    view: &'v View,
    key: &[u8],
    block: u32,
    block_count: u32,
    persist: bool,
) -> Result<&'v Server, Failure> {
    home(view, key, placed_block(block, block_count), persist)
}

/// Add `item` to the group of `address` in `groups`, which keep the servers in the order they
/// were first seen: how a call gathers its keys, blocks or ranges per server.
pub(crate) fn push_grouped<'a, T>(groups: &mut Vec<(&'a str, Vec<T>)>, address: &'a str, item: T) {
    match groups.iter_mut().find(|(a, _)| *a == address) {
        Some((_, group)) => group.push(item),
        None => groups.push((address, vec![item])),
    }
}

/// Run `work` on every task, on up to `threads` threads (the calling one included); returns
/// each task's outcome in task order once all have finished.
pub(crate) fn run_parallel<T: Copy + Send + Sync, R: Send>(
    tasks: &[T],
    threads: usize,
    work: impl Fn(T) -> R + Sync,
) -> Vec<R> {
    if tasks.len() <= 1 || threads <= 1 {
        return tasks.iter().map(|&task| work(task)).collect();
    }
    let next = AtomicUsize::new(0);
    let outcomes: Mutex<Vec<Option<R>>> =
        Mutex::new(std::iter::repeat_with(|| None).take(tasks.len()).collect());
    let drain = || loop {
        let index = next.fetch_add(1, Ordering::Relaxed);
        let Some(&task) = tasks.get(index) else {
            return;
        };
        let outcome = work(task);
        outcomes.lock().expect("never poisoned")[index] = Some(outcome);
    };
    std::thread::scope(|scope| {
        for _ in 1..threads.min(tasks.len()) {
            scope.spawn(drain);
        }
        drain();
    });
    outcomes
        .into_inner()
        .expect("never poisoned")
        .into_iter()
        .map(|o| o.expect("every task ran"))
        .collect()
}

/// One object version's block reads, shared by the tickets of one [`Objects::read_blocks`].
struct ReadOf<'a> {
    objects: &'a Objects,
    bucket: &'a str,
    key: &'a str,
    version: u64,
    /// The object's data blocks (where each lives depends on it).
    block_count: u32,
    delete: bool,
    shared: SharedDest,
    received: &'a Received,
}

impl ReadOf<'_> {
    /// One DoGet of `ranges` from `address` with the newest context, counting what arrived per
    /// block; a stale epoch (refused before any byte was sent) is adopted and the ticket sent
    /// again.
    fn ranges_current(&self, address: &str, ranges: &[RangeTarget]) -> Result<(), Failure> {
        let connection = self
            .objects
            .connection(address)
            .map_err(|e| Failure::at(e, address))?;
        for attempt in 0..=STALE_EPOCH_RETRIES_MAX {
            let view = self.objects.view();
            let ticket = GetTicket {
                ctx: view.ctx.clone(),
                bucket: self.bucket.to_string(),
                key: self.key.to_string(),
                version: self.version,
                ranges: ranges
                    .iter()
                    .map(|r| BlockRange(r.block, r.offset, r.len))
                    .collect(),
                delete: self.delete,
            };
            let ticket = body(&ticket);
            // SAFETY: see `SharedDest`; this ticket's ranges are written by this call only.
            let dest = unsafe { self.shared.slice() };
            match connection.get_ranges_blocking(ticket, ranges, dest) {
                Err(error) if error.is_stale_epoch() => {
                    self.objects
                        .adopt_or_fail(Failure::at(error, address), attempt)?;
                }
                Err(error) => return Err(Failure::at(error, address)),
                Ok(outcome) => {
                    let mut received = self.received.lock().expect("never poisoned");
                    for (range, count) in ranges.iter().zip(&outcome.received) {
                        if *count > 0 {
                            *received.entry(range.block).or_insert(0) += count;
                        }
                    }
                    return match outcome.error {
                        Some(error) => Err(Failure::at(error, address)),
                        None => Ok(()),
                    };
                }
            }
        }
        unreachable!("the last attempt returns")
    }

    /// Find blocks written under an earlier weight map: probe the other servers in the ranking
    /// of each block's placement (its manifest's, for an object of one data block).
    fn moved_blocks(
        &self,
        view: &View,
        tried: &str,
        ranges: &[RangeTarget],
    ) -> Result<(), Failure> {
        for range in ranges {
            {
                let mut received = self.received.lock().expect("never poisoned");
                if received.get(&range.block) == Some(&range.len) {
                    continue;
                }
                received.remove(&range.block);
            }
            let mut found = false;
            let placed = placed_block(range.block, self.block_count);
            for server in view.ranked(self.key.as_bytes(), placed) {
                if server.address == tried {
                    continue;
                }
                match self.ranges_current(&server.address, std::slice::from_ref(range)) {
                    Ok(()) => {
                        found = true;
                        break;
                    }
                    Err(failure) if failure.error.is_not_found() => {
                        self.received
                            .lock()
                            .expect("never poisoned")
                            .remove(&range.block);
                    }
                    Err(failure) => return Err(failure),
                }
            }
            if !found {
                let what = format!("block {} of {}/{}", range.block, self.bucket, self.key);
                if let Some((error, server)) = view.lost_error(&what) {
                    return Err(Failure { error, server });
                }
                return Err(Failure::local(server_error(
                    Code::NotFound as i32,
                    "not_found",
                    format!("{what} is on no server of the job"),
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_runs_every_task_once_in_order() {
        let tasks: Vec<usize> = (0..37).collect();
        let out = run_parallel(&tasks, 5, |t| t * 2);
        assert_eq!(out, tasks.iter().map(|t| t * 2).collect::<Vec<_>>());
        assert_eq!(run_parallel(&[3usize], 8, |t| t + 1), vec![4]);
        assert!(run_parallel(&[] as &[usize], 8, |t| t).is_empty());
    }

    #[test]
    fn errors_keep_their_kind() {
        let e = server_error(5, "not_found", "b/k".into());
        assert_eq!(kind_of(&e), "not_found");
        assert!(e.is_not_found());
        let reply = failure_reply(&ClientError::Server {
            code: 9,
            message: "stale_epoch: {\"epoch\":2}".into(),
        });
        assert_eq!(reply.status, 9);
        assert!(reply_error(&reply).is_stale_epoch());
    }
}
