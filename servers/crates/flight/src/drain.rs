//! Drain state: once drained the server refuses writes, keeps serving reads and deletes, and
//! optionally exits when its store holds no records.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pocketflow_store::Store;

use crate::status::ServiceError;

/// Whether the server drains, and whether it should exit once empty.
#[derive(Debug, Default)]
pub struct Drain {
    draining: AtomicBool,
    exit_when_empty: AtomicBool,
    started: tokio::sync::Notify,
}

impl Drain {
    /// Start draining; `exit_when_empty` is sticky once set.
    pub fn start(&self, exit_when_empty: bool) {
        if exit_when_empty {
            self.exit_when_empty.store(true, Ordering::SeqCst);
        }
        self.draining.store(true, Ordering::SeqCst);
        self.started.notify_waiters();
    }

    /// Whether the server is draining.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Refuse a write while draining.
    pub fn check_write(&self, node_id: &str) -> Result<(), ServiceError> {
        if self.is_draining() {
            return Err(ServiceError::Draining {
                node_id: node_id.to_owned(),
            });
        }
        Ok(())
    }

    /// Resolve once a drain with `exit_when_empty` was requested and `store` holds no records,
    /// checking every `poll`.
    pub async fn wait_until_empty(&self, store: &Store, poll: Duration) {
        loop {
            let notified = self.started.notified();
            if self.exit_when_empty.load(Ordering::SeqCst) {
                break;
            }
            notified.await;
        }
        while !store.is_empty() {
            tokio::time::sleep(poll).await;
        }
    }
}
