//! The bookkeeping of a bounded pool of sessions, shared by the DoExchange pool (callers wait
//! asynchronously) and the direct-exchange pool (callers block their own thread).

use std::time::Duration;

use crate::error::ClientError;

/// A session a pool can hold.
pub(crate) trait Pooled {
    /// Whether it must not be reused.
    fn broken(&self) -> bool;
}

/// What acquiring gives: a pooled session, or the right to open a new one.
pub(crate) enum Acquired<S> {
    Idle(Box<S>),
    OpenNew,
}

/// Idle sessions, how many are open, and the bound.
pub(crate) struct PoolState<S> {
    // Boxed: a session moves in and out of the pool on every call, as one pointer.
    #[allow(clippy::vec_box)]
    idle: Vec<Box<S>>,
    open: usize,
    limit: usize,
    closed: bool,
}

impl<S: Pooled> PoolState<S> {
    pub(crate) fn new(limit: usize) -> Self {
        PoolState {
            idle: Vec::new(),
            open: 0,
            limit: limit.max(1),
            closed: false,
        }
    }

    /// Drop every idle session (they may all be stale).
    pub(crate) fn retire_idle(&mut self) {
        self.open -= self.idle.len();
        self.idle.clear();
    }

    /// An idle session or a slot to open one; `Ok(None)` when the caller has to wait.
    pub(crate) fn try_acquire(&mut self) -> Result<Option<Acquired<S>>, ClientError> {
        if self.closed {
            return Err(ClientError::InvalidArgument(
                "the connection is closed".into(),
            ));
        }
        if let Some(session) = self.idle.pop() {
            return Ok(Some(Acquired::Idle(session)));
        }
        if self.open < self.limit {
            self.open += 1;
            return Ok(Some(Acquired::OpenNew));
        }
        Ok(None)
    }

    /// Give back a session (or the slot of one that failed to open, with `None`).
    pub(crate) fn release(&mut self, session: Option<Box<S>>) {
        match session {
            Some(session) if !session.broken() && !self.closed && self.open <= self.limit => {
                self.idle.push(session)
            }
            _ => self.open -= 1,
        }
    }

    /// After the server refused a new session: keep to the sessions already open, if any.
    /// Returns whether the caller should wait for one of them.
    pub(crate) fn shrink(&mut self) -> bool {
        // The refused session's slot was already given back.
        if self.open == 0 {
            return false;
        }
        self.limit = self.open;
        true
    }

    /// Refuse new acquisitions; returns the idle sessions for the caller to drop unlocked.
    #[allow(clippy::vec_box)]
    pub(crate) fn close(&mut self) -> Vec<Box<S>> {
        self.closed = true;
        let idle = std::mem::take(&mut self.idle);
        self.open -= idle.len();
        idle
    }
}

/// The error of a caller that waited `patience` for a free session in vain: its own client is
/// busy, which says nothing of the server (never "unavailable").
pub(crate) fn no_free_session(patience: Duration) -> ClientError {
    ClientError::Busy(format!(
        "no free session of this client within {:.1}s",
        patience.as_secs_f64()
    ))
}
