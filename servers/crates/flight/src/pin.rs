//! PIN and UNPIN on the small-op session: zero-copy reads for processes on the server's host,
//! which map the shared DRAM arena and read pinned objects in place (docs/PROTOCOL.md, "Pins").

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pocketflow_protocol::action::PinStats;
use pocketflow_protocol::frame::{ChannelArgs, RequestOp};
use pocketflow_protocol::limits::{
    PINNED_ARENA_DIVISOR, PINNED_JOB_DIVISOR, PINS_PER_PROCESS_MAX, PIN_SWEEP_INTERVAL_MS,
};
use pocketflow_protocol::pin::{arena_socket_name, PinArgs, PinGrant};
use pocketflow_protocol::ObjectHeader;
use pocketflow_store::pins::{process_start_time, PinBounds, PinTable};
use pocketflow_store::{PinRead, SharedArena, StoreError};

use crate::service::{ServiceState, StorageService};
use crate::status::ServiceError;

/// The pin table of a store whose shared arena holds `capacity_bytes` (`None`: not shared).
pub(crate) fn table_for(capacity_bytes: &Option<u64>) -> Option<Arc<PinTable>> {
    let bytes_max = capacity_bytes.as_ref()? / PINNED_ARENA_DIVISOR;
    Some(Arc::new(PinTable::new(PinBounds {
        bytes_max,
        job_bytes_max: bytes_max / PINNED_JOB_DIVISOR,
        process_pins_max: PINS_PER_PROCESS_MAX,
    })))
}

/// How long the arena socket's thread waits after a failed accept before the next (doubled for
/// each failure in a row, up to a second).
const ARENA_ACCEPT_RETRY_MS: u64 = 10;

/// What an exchange op answers: its header and body.
type PinOutcome = (Option<ObjectHeader>, Bytes);

/// PIN: a small object's value as GET returns it, or a large object's one data block held for
/// the calling process, answered with where it lies in the arena.
pub(crate) async fn pin(
    state: &ServiceState,
    job: &str,
    op: &RequestOp,
) -> Result<PinOutcome, ServiceError> {
    // A server whose arena is not shared (or not served) answers OK with no header: the reader
    // then stops asking it for a while (every PIN would be refused).
    let served = state
        .arena_served
        .load(std::sync::atomic::Ordering::Acquire);
    let shared = state.pins.as_ref().zip(state.store.shared_arena());
    let Some((pins, arena)) = shared.filter(|_| served) else {
        return Ok((None, Bytes::new()));
    };
    let args = PinArgs::of_header(&op.header)?;
    // The pid is the caller's word; what the server checks is that it names a process it can see
    // (the same pid namespace), whose start time then tells a later process of that pid apart.
    let start_time =
        process_start_time(args.pid)
            .ok()
            .flatten()
            .ok_or(StoreError::NotPinnable {
                why: "the server cannot see the pinning process (another host or pid namespace)",
            })?;
    match state.store.pin_read(job, &op.bucket, &op.key).await? {
        PinRead::Value(header, value) => {
            state.stats.counters.add_out(value.len() as u64);
            Ok((Some(header), value))
        }
        PinRead::Block(header, bytes) => {
            let offset = arena
                .offset_of(&bytes)
                .expect("a DRAM block of a shared arena lies in it");
            let len = bytes.len() as u64;
            let pin_id = pins.pin(job, args.pid, start_time, bytes)?;
            let grant = PinGrant {
                offset,
                len,
                pin_id,
                arena_len: arena.len,
                server_pid: std::process::id(),
                nonce: arena.nonce,
            };
            Ok((Some(header), grant.encode()))
        }
    }
}

/// UNPIN: release a pin of the calling job and process; the reply's header says in its first
/// field whether one went (1) or there was none (0: already released or swept).
pub(crate) fn unpin(
    state: &ServiceState,
    job: &str,
    op: &RequestOp,
) -> Result<PinOutcome, ServiceError> {
    let args = PinArgs::of_header(&op.header)?;
    let released = state
        .pins
        .as_ref()
        .is_some_and(|pins| pins.unpin(job, args.pid, args.pin_id));
    let reply = ChannelArgs {
        a: u64::from(released),
        ..ChannelArgs::default()
    };
    Ok((Some(reply.to_header()), Bytes::new()))
}

/// The pin table's counters and bounds for `stats`, if the arena is shared.
pub(crate) fn stats(state: &ServiceState) -> Option<PinStats> {
    let pins = state.pins.as_ref()?;
    let counts = pins.counts();
    let bounds = pins.bounds();
    Some(PinStats {
        pins: counts.pins,
        pinned_bytes: counts.bytes,
        granted_total: counts.granted,
        refused_total: counts.refused,
        swept_total: counts.swept,
        pinned_bytes_max: bounds.bytes_max,
        job_pinned_bytes_max: bounds.job_bytes_max,
        process_pins_max: bounds.process_pins_max,
    })
}

/// Hand the arena's descriptor to each process of this server's uid that connects to the
/// abstract socket [`arena_socket_name`], on a thread of its own, forever (one connection at a
/// time: each is answered at once, and the kernel's backlog bounds those waiting), with the
/// peer's pid as this server sees it (a reader in another pid namespace learns that the pid it
/// pins under names another process here, and gives its pins back). A peer of another uid is
/// closed unanswered.
fn serve_arena_descriptor(arena: SharedArena) -> std::io::Result<()> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixListener};
    let name = arena_socket_name(std::process::id(), &arena.nonce);
    let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
    std::thread::Builder::new()
        .name("pocketflow-arena-fd".into())
        .spawn(move || {
            // SAFETY: geteuid has no preconditions.
            let own_uid = unsafe { libc::geteuid() };
            let mut failures = 0u32;
            for stream in listener.incoming() {
                let stream = match stream {
                    Ok(stream) => {
                        failures = 0;
                        stream
                    }
                    Err(e) => {
                        // Out of descriptors, say: back off (ARENA_ACCEPT_RETRY_MS, doubling to
                        // 1 s) instead of spinning on the same error; the kernel's backlog holds
                        // the waiting.
                        failures = failures.saturating_add(1);
                        if failures == 1 || failures.is_power_of_two() {
                            eprintln!("pocketflow-server: arena socket accept failed: {e}");
                        }
                        let wait = ARENA_ACCEPT_RETRY_MS << failures.min(7).saturating_sub(1);
                        std::thread::sleep(Duration::from_millis(wait.min(1000)));
                        continue;
                    }
                };
                if let Some(peer) = peer_cred(&stream).filter(|peer| peer.uid == own_uid) {
                    // A peer that went away meanwhile only loses its answer.
                    let _ = send_descriptor(&stream, arena.fd, peer.pid as u32);
                }
            }
        })?;
    Ok(())
}

/// The credentials of the peer of `stream` (`SO_PEERCRED`).
fn peer_cred(stream: &std::os::unix::net::UnixStream) -> Option<libc::ucred> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writing a `ucred`.
    let got = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (got == 0).then_some(cred)
}

/// Send `peer_pid` (u32, little-endian) with `fd` attached (`SCM_RIGHTS`).
fn send_descriptor(
    stream: &std::os::unix::net::UnixStream,
    fd: i32,
    peer_pid: u32,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut payload = peer_pid.to_le_bytes();
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
    // SAFETY: `msg` has a control buffer of CMSG_SPACE(4) bytes, so the first header fits and
    // its data holds one descriptor.
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&msg);
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(header).cast::<i32>(), fd);
    }
    // SAFETY: `msg` points at live buffers for the call's duration.
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent != payload.len() as isize {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl StorageService {
    /// Start handing the shared arena's descriptor to readers of this host and uid (see
    /// `serve_arena_descriptor`); does nothing if the arena is not shared. Until this succeeds
    /// PIN answers as a server without a shared arena (readers copy), so a server whose socket
    /// cannot be bound still serves, privately.
    pub fn serve_shared_arena(&self) -> std::io::Result<()> {
        match self.state.store.shared_arena() {
            Some(arena) => {
                serve_arena_descriptor(arena)?;
                self.state
                    .arena_served
                    .store(true, std::sync::atomic::Ordering::Release);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Release the pins of processes that are gone, every `PIN_SWEEP_INTERVAL_MS`, forever (the
    /// task is dropped with the runtime); returns at once if the arena is not shared.
    pub async fn sweep_pins(self) {
        let Some(pins) = self.state.pins.clone() else {
            return;
        };
        let mut tick = tokio::time::interval(Duration::from_millis(PIN_SWEEP_INTERVAL_MS));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let pins = Arc::clone(&pins);
            // Reading /proc is blocking file I/O: off the runtime's workers.
            let _ = tokio::task::spawn_blocking(move || pins.sweep(process_start_time)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pocketflow_protocol::frame::OpCode;
    use pocketflow_protocol::token::TokenKey;
    use pocketflow_store::{Store, StoreConfig, Tier};

    use crate::service::ServiceConfig;

    #[tokio::test]
    async fn pins_are_answered_as_unshared_until_the_arena_is_served() {
        let store = Store::open(StoreConfig {
            tier: Tier::Dram,
            capacity_bytes: 1 << 20,
            nvme_path: None,
            long_running: false,
            persist_ttl: None,
            shared_dram: true,
        })
        .unwrap();
        let service = StorageService::new(
            store,
            ServiceConfig {
                node_id: "pin-test".into(),
                token_key: TokenKey::new(b"0123456789abcdef").unwrap(),
                transfer_idle: Duration::from_secs(30),
            },
        );
        let op = RequestOp {
            request_id: 0,
            op: OpCode::Pin,
            flags: 0,
            bucket: "b".into(),
            key: "k".into(),
            header: PinArgs {
                pid: std::process::id(),
                pin_id: 0,
            }
            .to_header(),
            value: Bytes::new(),
        };
        // A server whose socket is not (or could not be) bound: "not shared", the reader copies.
        let (header, body) = pin(&service.state, "j", &op).await.unwrap();
        assert!(header.is_none() && body.is_empty());
        // Served: the PIN is looked at (and refused here: there is no such bucket).
        service.serve_shared_arena().unwrap();
        assert!(pin(&service.state, "j", &op).await.is_err());
    }
}
