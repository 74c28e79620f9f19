//! Write-behind of the NVMe engine: a block's last chunk writes may still be in the kernel when
//! its put returns, so that the writer (and the task behind it) goes on computing while the
//! device writes. The chunks' staging memory stays held until each write completes, so the
//! engine's `staging_bytes_max` bounds the bytes written behind and is the backpressure: a new
//! write waits for staging memory while the device is behind. A read of the block waits for its
//! writes here, and gets a typed error if one failed; the extent stays allocated until they
//! complete (the writes hold it), so a deleted block's space is never reused under them.

use tokio::sync::watch;

/// How a block's writes ended: `None` while some are in the kernel.
type Outcome = Option<Result<(), String>>;

/// The pending writes of one block, shared by its handle's clones.
#[derive(Clone, Debug)]
pub(crate) struct WriteBehind {
    outcome: watch::Receiver<Outcome>,
}

/// The completing side of a [`WriteBehind`], held by the task that reaps the block's writes.
pub(crate) struct WriteBehindDone {
    outcome: watch::Sender<Outcome>,
}

impl WriteBehind {
    /// Pending writes, and the handle that settles them.
    pub(crate) fn start() -> (WriteBehindDone, Self) {
        let (outcome, receiver) = watch::channel(None);
        (WriteBehindDone { outcome }, Self { outcome: receiver })
    }

    /// Wait until every write of the block completed; `Err` carries the first failure (as
    /// text: the block's bytes are not on the device) or says the engine stopped first.
    pub(crate) async fn wait(&self) -> Result<(), String> {
        let mut outcome = self.outcome.clone();
        let settled = match outcome.wait_for(Option::is_some).await {
            Ok(settled) => settled.clone().expect("a settled outcome"),
            Err(_) => Err("the engine stopped before the block's writes completed".to_string()),
        };
        settled
    }

    /// Whether every write of the block completed (successfully or not).
    pub(crate) fn settled(&self) -> bool {
        self.outcome.borrow().is_some()
    }
}

impl WriteBehindDone {
    /// Settle the block's writes: `Ok` once all completed, or the first failure.
    pub(crate) fn settle(self, outcome: Result<(), String>) {
        // No receiver left means the block was dropped already: nobody to tell.
        let _ = self.outcome.send(Some(outcome));
    }
}
