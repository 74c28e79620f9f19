//! Zero-copy reads from the storage servers of this host: objects pinned in a server's shared
//! DRAM arena (PIN), which this process maps read-only once per server and reads in place.
//!
//! What cannot be pinned (a server on another host or without a shared arena, an object of
//! several data blocks or on NVMe, a refusal at a bound, an arena this process may not have) is
//! left to the caller, which reads it as usual: a reader always gets its bytes. A pin is
//! released when its [`Pinned`] is dropped, by UNPINs batched per server on a thread of the
//! process, also after the client was closed or dropped (the thread then opens connections of
//! its own); a process that ends with pins leaves them to the server's sweep.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};

use bytes::Bytes;
use pocketflow_protocol::frame::OpCode;
use pocketflow_protocol::pin::{arena_socket_name, PinArgs, PinGrant, ARENA_NONCE_BYTES};
use pocketflow_protocol::ObjectHeader;

use crate::config::ConnectionConfig;
use crate::connection::{Connection, ExchangeRequest};
use crate::error::ClientError;
use crate::failure::reply_error;
use crate::homes::home;
use crate::objects::Objects;
use crate::parallel::{push_grouped, run_parallel};
use crate::runtime::process_id;
use crate::view::{stale_weight_map, View};

/// Most servers a PIN of one key is sent to in turn: its home, then earlier homes.
const PIN_ROUNDS_MAX: usize = 3;

/// How long a server found without a shared arena (or whose arena this process could not map)
/// is not asked to pin.
const UNSHARED_RETRY: std::time::Duration = std::time::Duration::from_secs(30);

/// Most UNPINs sent in one exchange.
pub const UNPIN_BATCH_MAX: usize = 1024;

/// Bytes of a page, the step of touching a range where `MADV_POPULATE_READ` is missing.
const PAGE_BYTES: usize = 4096;

/// A server's arena mapped read-only into this process; unmapped when the last pin on it goes
/// (the client holds it weakly).
#[derive(Debug)]
pub struct ArenaMap {
    base: *const u8,
    len: usize,
}

// SAFETY: a read-only shared mapping; the bytes a reader looks at are pinned (unchanging).
unsafe impl Send for ArenaMap {}
// SAFETY: see `Send`.
unsafe impl Sync for ArenaMap {}

impl ArenaMap {
    /// Map the arena of `grant` read-only, its descriptor had from the server's socket
    /// ([`arena_socket_name`]; the server answers processes of its own uid only), and check
    /// that it starts with the grant's nonce (else it is another server's arena).
    fn open(grant: &PinGrant) -> Result<ArenaMap, ClientError> {
        use std::os::fd::AsRawFd;
        let name = arena_socket_name(grant.server_pid, &grant.nonce);
        let (file, seen_pid) = receive_arena(&name)
            .map_err(|e| ClientError::Unavailable(format!("no arena from @{name}: {e}")))?;
        // In another pid namespace the pid this process pins under names another process on
        // the server's side: its pins would not be its own (nor swept when it ends).
        if seen_pid != process_id() {
            return Err(ClientError::Unavailable(format!(
                "the server sees this process as pid {seen_pid}, not {}: another pid namespace",
                process_id()
            )));
        }
        let path = format!("@{name}");
        let len = file
            .metadata()
            .map_err(|e| ClientError::Unavailable(format!("cannot stat {path}: {e}")))?
            .len();
        if len != grant.arena_len {
            return Err(ClientError::Protocol(format!(
                "{path} holds {len} bytes, the server's arena {}",
                grant.arena_len
            )));
        }
        // SAFETY: a fresh read-only shared mapping of a file we opened; no address hint.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(ClientError::Unavailable(format!(
                "cannot map {path}: {}",
                std::io::Error::last_os_error()
            )));
        }
        let map = ArenaMap {
            base: raw.cast(),
            len: len as usize,
        };
        // SAFETY: the mapping is at least a page long (the nonce page) and readable.
        let start = unsafe { std::slice::from_raw_parts(map.base, ARENA_NONCE_BYTES) };
        if start != grant.nonce {
            return Err(ClientError::Protocol(format!(
                "{path} is not the arena the server named (its nonce differs)"
            )));
        }
        Ok(map)
    }

    /// The bytes `offset..offset + len` of the arena.
    fn slice(&self, offset: u64, len: u64) -> &[u8] {
        let end = offset.checked_add(len).expect("a grant's range fits u64");
        assert!(
            end as usize <= self.len,
            "a grant's range lies in its arena"
        );
        // SAFETY: in bounds of the mapping (checked above), which lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.base.add(offset as usize), len as usize) }
    }
}

impl Drop for ArenaMap {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping made in `open`, which no slice outlives.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

/// Receive a server's arena descriptor from the abstract Unix socket `name`, with this
/// process's pid as the server sees it.
fn receive_arena(name: &str) -> std::io::Result<(std::fs::File, u32)> {
    use std::os::fd::{AsRawFd, FromRawFd};
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixStream};
    let stream = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    let mut payload = [0u8; 4];
    let mut iov = libc::iovec {
        iov_base: payload.as_mut_ptr().cast(),
        iov_len: payload.len(),
    };
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<i32>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: an all-zero msghdr is valid; its pointers are set below to live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at live buffers for the call's duration.
    let got = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if got != payload.len() as isize {
        return Err(match got {
            0 => std::io::Error::new(std::io::ErrorKind::PermissionDenied, "the server refused"),
            _ => std::io::Error::last_os_error(),
        });
    }
    // SAFETY: the kernel filled `msg`'s control buffer; CMSG_FIRSTHDR reads within it.
    let header = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    // SAFETY: `header`, when not null, points at a complete control message header.
    let fd = unsafe {
        if header.is_null()
            || (*header).cmsg_level != libc::SOL_SOCKET
            || (*header).cmsg_type != libc::SCM_RIGHTS
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "no descriptor in the answer",
            ));
        }
        std::ptr::read_unaligned(libc::CMSG_DATA(header).cast::<i32>())
    };
    // SAFETY: the descriptor was just received and nothing else owns it.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    Ok((file, u32::from_le_bytes(payload)))
}

/// Make `bytes` (of a shared mapping) present in this process's page tables, so the reader
/// does not fault on them later: `MADV_POPULATE_READ`, or a read of one byte per page.
fn populate(bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    let start = bytes.as_ptr() as usize;
    let aligned = start & !(PAGE_BYTES - 1);
    let len = start + bytes.len() - aligned;
    // SAFETY: advising pages of a live read-only mapping; the range covers `bytes`' pages.
    let done =
        unsafe { libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_POPULATE_READ) } == 0;
    if !done {
        // Kernels before 5.14.
        for at in (0..bytes.len()).step_by(PAGE_BYTES) {
            // SAFETY: in bounds of `bytes`.
            unsafe { std::ptr::read_volatile(bytes.as_ptr().add(at)) };
        }
    }
}

/// Page ranges `(start, end)` (addresses), with how many live views lie in each.
type Ranges = std::collections::BTreeMap<(usize, usize), usize>;

/// The page ranges under this process's live [`Pinned`]s, so that a forked child can make them
/// its own (`after_fork_in_child`).
static LIVE_RANGES: Mutex<Ranges> = Mutex::new(std::collections::BTreeMap::new());

std::thread_local! {
    /// `LIVE_RANGES`, locked by the forking thread from before `fork` until after it.
    static HELD_OVER_FORK: std::cell::RefCell<Option<std::sync::MutexGuard<'static, Ranges>>> =
        const { std::cell::RefCell::new(None) };
}

extern "C" fn before_fork() {
    let guard = LIVE_RANGES.lock().unwrap_or_else(|e| e.into_inner());
    HELD_OVER_FORK.with(|held| *held.borrow_mut() = Some(guard));
}

extern "C" fn after_fork_in_parent() {
    HELD_OVER_FORK.with(|held| drop(held.borrow_mut().take()));
}

/// In a forked child: the parent still unpins the pins whose views the child inherited, after
/// which the server may reuse their bytes. So each page range under a live view is made a
/// private copy at the same address (copied out, mapped over with private anonymous memory,
/// copied back, made read-only again): the child's views keep their bytes. Only the forking
/// thread runs in the child, and the ranges are locked from before the fork.
extern "C" fn after_fork_in_child() {
    HELD_OVER_FORK.with(|held| {
        let Some(ranges) = held.borrow_mut().take() else {
            return;
        };
        // In order of start (the map's order).
        let spans: Vec<(usize, usize)> = ranges.keys().copied().collect();
        let mut merged: Vec<(usize, usize)> = Vec::with_capacity(spans.len());
        for (start, end) in spans {
            match merged.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => merged.push((start, end)),
            }
        }
        for (start, end) in merged {
            privatize(start, end - start);
        }
        drop(ranges);
    });
}

/// Replace the `len` bytes (whole pages) of a shared mapping at `start` by a private read-only
/// copy of them at the same address; aborts the process if it cannot (its views would be wrong).
fn privatize(start: usize, len: usize) {
    let mut copy = vec![0u8; len];
    // SAFETY: `start..start + len` lies in a live read-only mapping (a live pin's pages).
    unsafe { std::ptr::copy_nonoverlapping(start as *const u8, copy.as_mut_ptr(), len) };
    // SAFETY: replacing pages of our own mapping at their address; nothing reads them meanwhile
    // (only this thread runs in the child).
    let raw = unsafe {
        libc::mmap(
            start as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED || raw as usize != start {
        eprintln!("pocketflow: a forked child cannot copy its inherited views; it ends");
        std::process::abort();
    }
    // SAFETY: the fresh private mapping is `len` bytes, writable, and disjoint from `copy`.
    unsafe {
        std::ptr::copy_nonoverlapping(copy.as_ptr(), start as *mut u8, len);
        libc::mprotect(start as *mut libc::c_void, len, libc::PROT_READ);
    }
}

/// Register the fork handlers once in this process.
fn watch_forks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: the handlers are `extern "C"` functions that live for the whole process.
        unsafe {
            libc::pthread_atfork(
                Some(before_fork),
                Some(after_fork_in_parent),
                Some(after_fork_in_child),
            )
        };
    });
}

/// The page range of one live view, registered in `LIVE_RANGES` while it lives.
#[derive(Debug)]
struct LiveRange {
    start: usize,
    end: usize,
}

impl LiveRange {
    fn new(bytes: &[u8]) -> Option<LiveRange> {
        if bytes.is_empty() {
            return None;
        }
        watch_forks();
        let start = bytes.as_ptr() as usize & !(PAGE_BYTES - 1);
        let end = (bytes.as_ptr() as usize + bytes.len()).next_multiple_of(PAGE_BYTES);
        let mut ranges = LIVE_RANGES.lock().unwrap_or_else(|e| e.into_inner());
        *ranges.entry((start, end)).or_insert(0) += 1;
        Some(LiveRange { start, end })
    }
}

impl Drop for LiveRange {
    fn drop(&mut self) {
        let mut ranges = LIVE_RANGES.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(views) = ranges.get_mut(&(self.start, self.end)) {
            *views -= 1;
            if *views == 0 {
                ranges.remove(&(self.start, self.end));
            }
        }
    }
}

/// One pinned object: its bytes in a server's arena, held until this is dropped. A forked
/// child's inherited ones are private copies (same address, same bytes), which the child
/// neither unpins nor needs to.
#[derive(Debug)]
pub struct Pinned {
    // Fields drop in this order: the range is unregistered before the pin can go, and both
    // before the arena can be unmapped.
    _live: Option<LiveRange>,
    _release: Release,
    arena: Arc<ArenaMap>,
    offset: u64,
    len: u64,
    header: ObjectHeader,
}

impl Pinned {
    /// The object's bytes, read in place.
    pub fn bytes(&self) -> &[u8] {
        self.arena.slice(self.offset, self.len)
    }

    /// The object's header.
    pub fn header(&self) -> ObjectHeader {
        self.header
    }
}

/// What releases one pin when dropped.
#[derive(Debug)]
struct Release {
    releaser: Arc<Releaser>,
    address: String,
    pin_id: u64,
}

impl Drop for Release {
    fn drop(&mut self) {
        self.releaser
            .push(std::mem::take(&mut self.address), self.pin_id);
    }
}

/// One key's outcome of [`Objects::pin_many`].
#[derive(Debug)]
pub enum SharedRead {
    /// The object's bytes, pinned in place.
    Pinned(Pinned),
    /// A small object's bytes, which came with the reply.
    Value(Bytes),
    /// Not pinned: the caller reads it as usual (its failure, if any, shows there).
    Copy,
}

/// Counts of the zero-copy reads of one client.
#[derive(Debug, Default)]
pub struct SharedCounts {
    /// Objects read in place.
    pub pinned: AtomicU64,
    /// Objects that came back in a PIN's reply (small ones).
    pub values: AtomicU64,
    /// Objects left to a copying read: refused by the server, or not asked.
    pub copied: AtomicU64,
}

/// The zero-copy state of one client: mapped arenas, servers without one, the pin releaser.
#[derive(Debug, Default)]
pub struct Shared {
    /// Mapped arenas, by server address, with the server pid they were had from: held weakly
    /// (the pins on an arena hold it), replaced when its server's is, forgotten at close.
    arenas: Mutex<HashMap<String, (u32, Weak<ArenaMap>)>>,
    /// Servers whose arena is not shared (or not reachable from this process), with when that
    /// was seen: not asked again for `UNSHARED_RETRY` (a failure may pass; a server may be
    /// restarted with a shared arena at the same address).
    unshared: Mutex<HashMap<String, std::time::Instant>>,
    /// The releaser of this process's pins (made again in a forked child).
    releaser: Mutex<Option<Arc<Releaser>>>,
    /// Counts.
    pub counts: SharedCounts,
}

/// Unpins waiting to be sent; a thread sends them, batched per server. Each pin enters once, so
/// the queue is bounded by the pins a process may hold (`PINS_PER_PROCESS_MAX` per server). It
/// outlives its client as long as pins do: once the client is closed or gone, it sends over
/// connections of its own, made with the client's config and its last map.
#[derive(Debug)]
struct Releaser {
    pid: u32,
    queue: Mutex<Vec<(String, u64)>>,
    ready: Condvar,
    config: ConnectionConfig,
    window: usize,
    /// The client's map when it was last seen (or adopted here after a stale refusal).
    view: Mutex<Arc<View>>,
}

impl Releaser {
    fn push(&self, address: String, pin_id: u64) {
        // A forked child holds its parent's pins through inherited objects: not its to release.
        if process_id() != self.pid {
            return;
        }
        self.queue
            .lock()
            .expect("never poisoned")
            .push((address, pin_id));
        self.ready.notify_one();
    }

    /// Send the queued unpins until nothing but this thread holds the releaser (the client and
    /// every pin are gone) and the queue is empty.
    fn run(self: Arc<Self>, objects: Weak<Objects>) {
        loop {
            let batch: Vec<(String, u64)> = {
                let mut queue = self.queue.lock().expect("never poisoned");
                while queue.is_empty() {
                    let (next, _) = self
                        .ready
                        .wait_timeout(queue, std::time::Duration::from_secs(1))
                        .expect("never poisoned");
                    queue = next;
                    if queue.is_empty() && Arc::strong_count(&self) == 1 {
                        return;
                    }
                }
                std::mem::take(&mut *queue)
            };
            self.send(objects.upgrade().as_deref(), &batch);
        }
    }

    /// Send everything queued now, on the calling thread (a client about to close).
    fn flush(&self, objects: &Objects) {
        let batch = std::mem::take(&mut *self.queue.lock().expect("never poisoned"));
        if !batch.is_empty() {
            self.send(Some(objects), &batch);
        }
    }

    /// Send the UNPINs of `batch`, over `objects`' connections while it is open, else over
    /// connections of this releaser's own (closed when sent).
    fn send(&self, objects: Option<&Objects>, batch: &[(String, u64)]) {
        let mut groups: Vec<(&str, Vec<u64>)> = Vec::new();
        for (address, pin_id) in batch {
            push_grouped(&mut groups, address, *pin_id);
        }
        if let Some(objects) = objects {
            *self.view.lock().expect("never poisoned") = objects.view();
        }
        let open = objects.filter(|o| !o.is_closed());
        for (address, ids) in groups {
            let own = match open {
                Some(_) => None,
                None => match Connection::new(address, self.config.clone()) {
                    Ok(connection) => Some(connection),
                    Err(_) => continue, // Left to the server's sweep.
                },
            };
            for chunk in ids.chunks(UNPIN_BATCH_MAX) {
                let requests = unpin_requests(self.pid, chunk);
                // A session opened under a stale map is refused before it runs anything: adopt
                // the new map and send again. An unpin that fails otherwise (server gone or
                // hung) is left to the server's sweep.
                for _ in 0..2 {
                    let view = Arc::clone(&self.view.lock().expect("never poisoned"));
                    let sent = match (&own, open) {
                        (Some(connection), _) => connection.exchange_blocking(
                            &view.exchange_command,
                            view.epoch,
                            &requests,
                            self.window,
                        ),
                        (None, Some(objects)) => objects.exchange(&view, address, &requests),
                        (None, None) => break,
                    };
                    match sent {
                        Err(error) if error.is_stale_epoch() => {
                            if !self.adopt(objects, &view, &error) {
                                break;
                            }
                        }
                        _ => break,
                    }
                }
            }
            if let Some(connection) = own {
                connection.close();
            }
        }
    }

    /// Adopt the newer map a stale refusal carries (in the client too, if it is there);
    /// returns whether there was one.
    fn adopt(&self, objects: Option<&Objects>, view: &View, error: &ClientError) -> bool {
        if let Some(objects) = objects {
            if objects.adopt(error).is_err() {
                return false;
            }
            *self.view.lock().expect("never poisoned") = objects.view();
            return true;
        }
        let ClientError::Server { message, .. } = error else {
            return false;
        };
        let newer = stale_weight_map(message).and_then(|map| view.with_weight_map(&map).ok());
        match newer {
            Some(newer) if newer.epoch > view.epoch => {
                *self.view.lock().expect("never poisoned") = Arc::new(newer);
                true
            }
            _ => false,
        }
    }
}

/// The UNPINs of `pin_ids`, pinned by process `pid`.
fn unpin_requests(pid: u32, pin_ids: &[u64]) -> Vec<ExchangeRequest> {
    pin_ids
        .iter()
        .map(|&pin_id| ExchangeRequest {
            op: OpCode::Unpin,
            flags: 0,
            bucket: "_".into(),
            key: "_".into(),
            header: PinArgs { pid, pin_id }.to_header(),
            value: Bytes::new(),
        })
        .collect()
}

/// Whether `address` (`host:port`) names this host's loopback.
fn is_loopback(address: &str) -> bool {
    let host = address
        .rsplit_once(':')
        .map_or(address, |(host, _)| host)
        .trim_matches(['[', ']']);
    host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

impl Objects {
    fn releaser(self: &Arc<Self>) -> Arc<Releaser> {
        let mut slot = self.shared.releaser.lock().expect("never poisoned");
        if let Some(releaser) = slot.as_ref().filter(|r| r.pid == process_id()) {
            return Arc::clone(releaser);
        }
        let releaser = Arc::new(Releaser {
            pid: process_id(),
            queue: Mutex::new(Vec::new()),
            ready: Condvar::new(),
            config: self.config.clone(),
            window: self.exchange_window,
            view: Mutex::new(self.view()),
        });
        let objects = Arc::downgrade(self);
        let running = Arc::clone(&releaser);
        std::thread::Builder::new()
            .name("pocketflow-unpin".into())
            .spawn(move || running.run(objects))
            .expect("cannot start the unpin thread");
        *slot = Some(Arc::clone(&releaser));
        releaser
    }

    fn arena(&self, address: &str, grant: &PinGrant) -> Result<Arc<ArenaMap>, ClientError> {
        let id = grant.server_pid;
        let mut arenas = self.shared.arenas.lock().expect("never poisoned");
        if let Some(mapped) = arenas
            .get(address)
            .filter(|(of, _)| *of == id)
            .and_then(|(_, map)| map.upgrade())
            .filter(|map| {
                map.len as u64 == grant.arena_len
                    && map.slice(0, ARENA_NONCE_BYTES as u64) == grant.nonce
            })
        {
            return Ok(mapped);
        }
        let mapped = Arc::new(ArenaMap::open(grant)?);
        arenas.insert(address.to_string(), (id, Arc::downgrade(&mapped)));
        Ok(mapped)
    }

    /// Before the client closes: send the unpins queued now, and forget the mapped arenas (each
    /// stays mapped while pins on it live). Pins dropped later are still released, over the
    /// releaser's own connections.
    pub(crate) fn close_shared(&self) {
        let releaser = self.shared.releaser.lock().expect("never poisoned").clone();
        if let Some(releaser) = releaser.filter(|r| r.pid == process_id()) {
            releaser.flush(self);
        }
        self.shared.arenas.lock().expect("never poisoned").clear();
    }

    /// Pin `keys` of `bucket` where they live (their home under the current map, then, for a
    /// key not found there once the job's map has changed, the homes earlier maps gave it: a
    /// grow moves about a quarter of keys' homes and data never moves), on loopback servers with
    /// a shared arena, every server at once, and make the pinned bytes present in this process.
    /// Each key's outcome, in order; [`SharedRead::Copy`] for each key the caller must read
    /// itself.
    pub fn pin_many(self: &Arc<Self>, bucket: &str, keys: &[&str]) -> Vec<SharedRead> {
        let view = self.view();
        // Where to ask for each key, in order: its home, then its earlier homes.
        let candidates: Vec<Vec<&str>> = keys
            .iter()
            .map(|key| {
                let mut at: Vec<&str> = Vec::new();
                if let Ok(server) = home(&view, key.as_bytes(), 0, false) {
                    at.push(&server.address);
                }
                for earlier in view.earlier_homes(key.as_bytes()).unwrap_or_default() {
                    let address = view.servers[earlier].address.as_str();
                    if !at.contains(&address) {
                        at.push(address);
                    }
                }
                at
            })
            .collect();
        let mut reads: Vec<SharedRead> = std::iter::repeat_with(|| SharedRead::Copy)
            .take(keys.len())
            .collect();
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        let pid = process_id();
        let mut releaser: Option<Arc<Releaser>> = None;
        for round in 0..PIN_ROUNDS_MAX {
            let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
            {
                let unshared = self.shared.unshared.lock().expect("never poisoned");
                for &index in &pending {
                    if let Some(&address) = candidates[index].get(round) {
                        let skipped = unshared
                            .get(address)
                            .is_some_and(|since| since.elapsed() < UNSHARED_RETRY);
                        if is_loopback(address) && !skipped {
                            push_grouped(&mut groups, address, index);
                        }
                    }
                }
            }
            if groups.is_empty() {
                break;
            }
            let releaser = releaser.get_or_insert_with(|| self.releaser());
            let tasks: Vec<usize> = (0..groups.len()).collect();
            let per_server = run_parallel(&tasks, self.io_threads.max(groups.len()), |task| {
                let (address, indexes) = &groups[task];
                self.pin_at(&view, bucket, keys, address, indexes, pid, releaser)
            });
            pending.clear();
            for (index, read) in per_server.into_iter().flatten() {
                match read {
                    Some(read) => reads[index] = read,
                    None => pending.push(index),
                }
            }
        }
        let counts = &self.shared.counts;
        for read in &reads {
            let counter = match read {
                SharedRead::Pinned(_) => &counts.pinned,
                SharedRead::Value(_) => &counts.values,
                SharedRead::Copy => &counts.copied,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        reads
    }

    /// Read from server `address` by copies for `UNSHARED_RETRY` (it answered that its arena
    /// is not shared, or this process cannot map it).
    fn mark_unshared(&self, address: &str) {
        self.shared
            .unshared
            .lock()
            .expect("never poisoned")
            .insert(address.to_string(), std::time::Instant::now());
    }

    /// One server's PINs of `indexes` of `keys`: each key's outcome, `None` for a key the
    /// server does not hold (its record may be at an earlier home).
    #[allow(clippy::too_many_arguments)]
    fn pin_at(
        &self,
        view: &crate::view::View,
        bucket: &str,
        keys: &[&str],
        address: &str,
        indexes: &[usize],
        pid: u32,
        releaser: &Arc<Releaser>,
    ) -> Vec<(usize, Option<SharedRead>)> {
        let requests: Vec<ExchangeRequest> = indexes
            .iter()
            .map(|&index| ExchangeRequest {
                op: OpCode::Pin,
                flags: 0,
                bucket: bucket.to_string(),
                key: keys[index].to_string(),
                header: PinArgs { pid, pin_id: 0 }.to_header(),
                value: Bytes::new(),
            })
            .collect();
        let Ok(replies) = self.exchange(view, address, &requests) else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(replies.len());
        let mut give_back: Vec<u64> = Vec::new();
        for (&index, reply) in indexes.iter().zip(replies) {
            let read = match (reply.status, reply.header) {
                (0, None) => {
                    self.mark_unshared(address);
                    SharedRead::Copy
                }
                (0, Some(header)) if header.block_count == 0 => SharedRead::Value(reply.body),
                (0, Some(header)) => match PinGrant::decode(&reply.body) {
                    Ok(grant) => {
                        match self.arena(address, &grant) {
                            Ok(arena) => {
                                let live = LiveRange::new(arena.slice(grant.offset, grant.len));
                                let pinned = Pinned {
                                    _live: live,
                                    // Released by its drop.
                                    _release: Release {
                                        releaser: Arc::clone(releaser),
                                        address: address.to_string(),
                                        pin_id: grant.pin_id,
                                    },
                                    arena,
                                    offset: grant.offset,
                                    len: grant.len,
                                    header,
                                };
                                populate(pinned.bytes());
                                SharedRead::Pinned(pinned)
                            }
                            Err(_) => {
                                // Another uid or pid namespace, or a server gone: this
                                // process copies, and gives the pin back in this call.
                                self.mark_unshared(address);
                                give_back.push(grant.pin_id);
                                SharedRead::Copy
                            }
                        }
                    }
                    Err(_) => SharedRead::Copy,
                },
                _ if reply_error(&reply).is_not_found() => {
                    out.push((index, None));
                    continue;
                }
                _ => SharedRead::Copy,
            };
            out.push((index, Some(read)));
        }
        if !give_back.is_empty() {
            // Before the call returns, so a process that ends right after leaves nothing
            // pinned under a pid that may not be its own (the sweep could not tell).
            let _ = self.exchange(view, address, &unpin_requests(pid, &give_back));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_addresses_are_local() {
        assert!(is_loopback("127.0.0.1:5000"));
        assert!(is_loopback("127.3.2.1:5000"));
        assert!(is_loopback("[::1]:5000"));
        assert!(is_loopback("localhost:5000"));
        assert!(!is_loopback("10.0.0.5:5000"));
        assert!(!is_loopback("example.com:5000"));
    }
}
