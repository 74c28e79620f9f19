//! Why the server stops: SIGTERM or SIGINT, the parent process going away, or a drain that asked
//! to exit once the store is empty.

use std::time::Duration;

use pocketflow_flight::bounds::WATCH_INTERVAL_MS;
use pocketflow_flight::StorageService;
use tokio::signal::unix::{signal, Signal, SignalKind};

/// The reason the server shuts down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// SIGTERM or SIGINT.
    Signal,
    /// The `--parent-pid` process is gone.
    ParentGone,
    /// Drained with `exit_when_empty` and holding no records.
    DrainedEmpty,
}

/// Whether process `pid` still exists, and (if it was our parent at start) is still our parent.
fn parent_alive(pid: i32, was_parent: bool) -> bool {
    // SAFETY: getppid and kill with signal 0 only query the process table.
    let (ppid, exists) = unsafe { (libc::getppid(), libc::kill(pid, 0) == 0) };
    let exists = exists || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    exists && (!was_parent || ppid == pid)
}

async fn parent_gone(parent_pid: Option<i32>) {
    let Some(pid) = parent_pid else {
        return std::future::pending().await;
    };
    // SAFETY: getppid has no preconditions.
    let was_parent = unsafe { libc::getppid() } == pid;
    let mut ticker = tokio::time::interval(Duration::from_millis(WATCH_INTERVAL_MS));
    loop {
        ticker.tick().await;
        if !parent_alive(pid, was_parent) {
            return;
        }
    }
}

/// SIGTERM and SIGINT handlers, installed before the server announces itself so that a signal
/// sent right after the ready line is never lost.
pub struct StopSignals {
    terminate: Signal,
    interrupt: Signal,
}

impl StopSignals {
    /// Install the handlers (needs the runtime).
    pub fn install() -> std::io::Result<Self> {
        Ok(Self {
            terminate: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
        })
    }
}

/// Resolve with the first reason to stop.
pub async fn stop_reason(
    mut signals: StopSignals,
    service: StorageService,
    parent_pid: Option<i32>,
) -> StopReason {
    tokio::select! {
        _ = signals.terminate.recv() => StopReason::Signal,
        _ = signals.interrupt.recv() => StopReason::Signal,
        () = parent_gone(parent_pid) => StopReason::ParentGone,
        () = service.drained_and_empty(Duration::from_millis(WATCH_INTERVAL_MS / 5)) => StopReason::DrainedEmpty,
    }
}
