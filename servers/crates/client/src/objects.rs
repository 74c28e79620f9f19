//! The object layer of one job's client: it owns the job's current [`View`] (and adopts the newer
//! map a `stale_epoch` answer carries) and one [`Connection`] per server, and runs the calls every
//! path of the layer makes through them. The paths live beside it, one concern each: block 0 of an
//! object (`records.rs`), whole reads (`reads.rs`), data blocks (`block_reads.rs`), writes
//! (`writes.rs`) and where they go when a server is full (`overflow.rs`), streamed uploads
//! (`upload.rs`), listings, waits and channels.
//!
//! Where things go (the same rules as the module doc of `pocketflow/client.py`): block 0 of an
//! object lives on the server placed for `(key, 0)`, PERSIST objects on the long-running servers'
//! placement; data block `i` on the server placed for `(key, i)`, except that the one data block of
//! a one-block object lives with its manifest (`homes::block_home`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use bytes::Bytes;
use pocketflow_protocol::action::ActionName;

use crate::config::ConnectionConfig;
use crate::connection::{Connection, ExchangeReply, ExchangeRequest};
use crate::error::ClientError;
use crate::failure::{failure_reply, Failure};
use crate::view::{stale_weight_map, View};

/// How many times one call adopts a newer weight map and retries (`STALE_EPOCH_RETRIES_MAX`
/// of `pocketflow/layout.py`).
pub const STALE_EPOCH_RETRIES_MAX: usize = 4;
/// Most threads one read moves blocks on, whatever the configuration says.
pub const IO_THREADS_MAX: usize = 64;

/// How a job's client spreads its work.
#[derive(Debug, Clone, Copy)]
pub struct Tuning {
    /// Most threads one object's data blocks move on.
    pub io_threads: usize,
    /// Most small operations in flight per session.
    pub exchange_window: usize,
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
    /// The servers that refused a write as full lately (`overflow.rs`).
    pub(crate) full_servers: Mutex<crate::overflow::FullServers>,
    /// Zero-copy reads: mapped arenas and the pin releaser (`shared.rs`).
    pub shared: crate::shared::Shared,
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
            full_servers: Mutex::new(crate::overflow::FullServers::default()),
            shared: crate::shared::Shared::default(),
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

    /// Whether the client was closed for good (`close(false)`).
    pub(crate) fn is_closed(&self) -> bool {
        self.connections.lock().expect("never poisoned").closed
    }

    /// Close every connection; with `reopen`, later calls make new ones (else they fail).
    /// Unpins queued now are sent first (`shared.rs`).
    pub fn close(&self, reopen: bool) {
        self.close_shared();
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

    pub(crate) fn call(
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

    pub(crate) fn call_or_stale(
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
}
