//! The io_uring ring of one NVMe engine: callers submit their own I/O; a Tokio task reaps it.
//!
//! A dedicated I/O thread cost two thread hops per I/O (caller -> I/O thread -> caller), which
//! at one I/O at a time was a large share of a 1 MiB read. Instead the calling task pushes its
//! entry and enters the kernel itself (the ring's queues sit behind a short mutex held only to
//! push or pop entries, never across a system call), and completions are reaped by a task on
//! the caller's own Tokio runtime, woken through an eventfd that the ring signals on every
//! completion and that the runtime's reactor polls. The kernel finishes a completion on the
//! thread that submitted it, normally a runtime thread, so no thread outside the runtime wakes.
//!
//! Bounds: at most `queue_depth` operations are in the kernel at once (one slot each, handed out
//! by a semaphore; further callers wait in FIFO order). A request owns its buffer, which stays in
//! its slot until the kernel is done with it, so a cancelled caller can never leave the kernel
//! writing into freed memory; the last owner of the ring waits for in-flight I/O before freeing.

use std::any::Any;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use io_uring::{opcode, types, IoUring};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

use super::buffer::AlignedBuf;
use crate::error::StoreError;

/// Attempts at entering the kernel when it answers with a transient error (EINTR, EAGAIN,
/// EBUSY) before the submitting caller gets the error.
const ENTER_ATTEMPTS_MAX: u32 = 64;

/// Direction of one direct I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IoKind {
    /// Read the file into the buffer.
    Read,
    /// Write the buffer to the file.
    Write,
}

/// One direct read or write of a whole aligned buffer at an aligned file offset.
pub(crate) struct IoRequest {
    pub kind: IoKind,
    pub file_offset: u64,
    pub buf: AlignedBuf,
    /// Staging-memory permit of `buf`, handed back with the completion.
    pub permit: Option<OwnedSemaphorePermit>,
    /// Keeps the target extent allocated until the kernel is done with it; dropped when the
    /// completion is reaped, before it is sent.
    pub keep_alive: Option<Box<dyn Any + Send>>,
}

/// The outcome of an [`IoRequest`], with its buffer and permit returned.
pub(crate) struct IoCompletion {
    pub result: io::Result<usize>,
    pub buf: AlignedBuf,
    pub permit: Option<OwnedSemaphorePermit>,
}

/// A request in the kernel and where its completion goes.
struct Submission {
    request: IoRequest,
    reply: oneshot::Sender<IoCompletion>,
}

/// Handle to the ring; dropping it stops the reaper once in-flight I/O completes.
pub(crate) struct Uring {
    shared: Arc<RingShared>,
}

/// State shared by submitting callers, the reaper task and the handle.
struct RingShared {
    ring: IoUring,
    file: Arc<File>,
    /// Signalled by the kernel on every completion (and by the handle at close).
    wake_fd: OwnedFd,
    /// One permit per free slot: bounds the operations in the kernel to the queue depth.
    slots_free: Semaphore,
    state: Mutex<RingState>,
    /// Set when the handle is dropped; the reaper ends once no slot is in use.
    closed: AtomicBool,
}

/// What the mutex guards: the ring's two queues (only touched with it held) and the slots.
struct RingState {
    slots: Vec<Option<Submission>>,
    free_slots: Vec<usize>,
    /// Most slots ever in use at once (tests check it against the queue depth).
    in_flight_high_water: usize,
}

impl RingState {
    fn in_flight(&self) -> usize {
        self.slots.len() - self.free_slots.len()
    }
}

impl Uring {
    /// Open a ring for `file` with at most `queue_depth` operations in the kernel and start its
    /// reaper on the current Tokio runtime.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime with I/O enabled (the reaper runs on the caller's runtime).
    pub fn start(file: Arc<File>, queue_depth: u32) -> Result<Self, StoreError> {
        assert!(queue_depth >= 1, "queue depth must be positive");
        // SAFETY: eventfd takes no pointers; a non-negative result is a fresh fd we own.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(ring_error("eventfd", io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a valid fd that nothing else owns.
        let wake_fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // The submission queue only holds entries of slots in use, so the queue depth fits; the
        // completion queue is twice as large, so it cannot overflow either.
        let ring = open_ring(queue_depth.next_power_of_two())
            .map_err(|e| ring_error("io_uring setup", e))?;
        ring.submitter()
            .register_eventfd(wake_fd.as_raw_fd())
            .map_err(|e| ring_error("io_uring register eventfd", e))?;
        let depth = queue_depth as usize;
        let shared = Arc::new(RingShared {
            ring,
            file,
            wake_fd,
            slots_free: Semaphore::new(depth),
            state: Mutex::new(RingState {
                slots: (0..depth).map(|_| None).collect(),
                free_slots: (0..depth).rev().collect(),
                in_flight_high_water: 0,
            }),
            closed: AtomicBool::new(false),
        });
        let wake_fd = WakeFd(Arc::clone(&shared));
        // SAFETY: `WakeFd` owns (through the ring) the eventfd it names, so the fd stays open and
        // the same for the life of the `AsyncFd`.
        let wake = unsafe { AsyncFd::register_with_interest(wake_fd, Interest::READABLE) }
            .map_err(|e| ring_error("register eventfd with the runtime", e.into_parts().1))?;
        tokio::spawn(reap_until_closed(wake));
        Ok(Self { shared })
    }

    /// Wait for a free slot, put `request` in the kernel and return the receiver of its
    /// completion.
    ///
    /// Cancel-safe: a caller dropped while waiting for a slot has submitted nothing, and one
    /// dropped after this returns leaves its buffer in the slot until the kernel is done.
    pub async fn submit(
        &self,
        request: IoRequest,
    ) -> Result<oneshot::Receiver<IoCompletion>, StoreError> {
        let permit = self
            .shared
            .slots_free
            .acquire()
            .await
            .map_err(|_| StoreError::EngineStopped)?;
        // The reaper returns the permit when it frees the slot.
        permit.forget();
        let (reply, completion) = oneshot::channel();
        self.shared.push(Submission { request, reply });
        self.shared.enter()?;
        Ok(completion)
    }

    /// Submit `request` and wait for its completion.
    pub async fn run(&self, request: IoRequest) -> Result<IoCompletion, StoreError> {
        let completion = self.submit(request).await?;
        completion.await.map_err(|_| StoreError::EngineStopped)
    }

    /// Most operations that were in the kernel at once since the ring opened.
    #[cfg(test)]
    pub fn in_flight_high_water(&self) -> usize {
        self.shared.lock().in_flight_high_water
    }
}

impl Drop for Uring {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        wake(&self.shared.wake_fd);
    }
}

/// An [`StoreError::Io`] of the ring, which concerns no path.
fn ring_error(op: &'static str, source: io::Error) -> StoreError {
    StoreError::Io {
        op,
        path: None,
        source,
    }
}

/// Create the ring. Any runtime thread may submit, so the single-issuer and deferred-task-run
/// modes are out; submit-all (kernel 5.18) keeps one bad entry from stranding the entries
/// queued behind it, and older kernels get a plain ring.
fn open_ring(entries: u32) -> io::Result<IoUring> {
    IoUring::builder()
        .setup_submit_all()
        .build(entries)
        .or_else(|_| IoUring::new(entries))
}

fn wake(fd: &OwnedFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writing 8 bytes from a live buffer to our eventfd. A full counter (EAGAIN) already
    // means "readable", so the result needs no handling.
    unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
}

/// Reset the eventfd's counter, so the reactor reports it readable again only after the next
/// completion.
fn drain(fd: &OwnedFd) {
    let mut counter = [0u8; 8];
    // SAFETY: reading 8 bytes into a live buffer from our non-blocking eventfd; an empty counter
    // (EAGAIN) needs no handling.
    unsafe { libc::read(fd.as_raw_fd(), counter.as_mut_ptr().cast(), counter.len()) };
}

impl RingShared {
    fn lock(&self) -> MutexGuard<'_, RingState> {
        self.state.lock().expect("io_uring state lock poisoned")
    }

    /// Put `submission` in a free slot and its entry in the submission queue (not yet entered).
    /// The caller holds one of `slots_free`'s permits, so a slot is free.
    fn push(&self, mut submission: Submission) {
        let fd = types::Fd(self.file.as_raw_fd());
        let request = &mut submission.request;
        let len = u32::try_from(request.buf.len()).expect("direct I/O of at most 4 GiB");
        let entry = match request.kind {
            IoKind::Read => opcode::Read::new(fd, request.buf.as_mut_ptr(), len)
                .offset(request.file_offset)
                .build(),
            IoKind::Write => opcode::Write::new(fd, request.buf.as_ptr(), len)
                .offset(request.file_offset)
                .build(),
        };
        let mut state = self.lock();
        let slot = state.free_slots.pop().expect("a free slot for each permit");
        // SAFETY: the buffer's heap memory does not move when the submission moves into its slot,
        // where it stays until the completion is reaped; the file stays open while the ring
        // lives. The submission queue is only touched with the state lock held.
        unsafe {
            self.ring
                .submission_shared()
                .push(&entry.user_data(slot as u64))
        }
        .expect("submission queue larger than the queue depth");
        state.slots[slot] = Some(submission);
        state.in_flight_high_water = state.in_flight_high_water.max(state.in_flight());
    }

    /// Enter the kernel to submit every queued entry (ours and any other caller's).
    ///
    /// On an error our entry may stay queued; its slot keeps the buffer, and the next caller's
    /// enter (or the ring's drop) submits it, so nothing is freed under the kernel.
    fn enter(&self) -> Result<(), StoreError> {
        let mut attempts = 0;
        loop {
            attempts += 1;
            match self.ring.submit() {
                Ok(_) => return Ok(()),
                Err(error) if is_transient(&error) && attempts < ENTER_ATTEMPTS_MAX => {
                    std::thread::yield_now();
                }
                Err(error) => return Err(ring_error("io_uring submit", error)),
            }
        }
    }

    /// Move every posted completion out of its slot into `done`, and free the slots.
    fn take_completions(&self, done: &mut Vec<(Submission, i32)>) {
        let mut state = self.lock();
        // SAFETY: the completion queue is only touched with the state lock held.
        for entry in unsafe { self.ring.completion_shared() } {
            let slot = entry.user_data() as usize;
            let submission = state.slots[slot].take().expect("completion of a used slot");
            state.free_slots.push(slot);
            done.push((submission, entry.result()));
        }
    }

    /// Take the posted completions, return their slots and hand each to its caller.
    fn reap(&self, done: &mut Vec<(Submission, i32)>) {
        self.take_completions(done);
        self.slots_free.add_permits(done.len());
        for (submission, result) in done.drain(..) {
            complete(submission, result);
        }
    }
}

impl Drop for RingShared {
    /// The kernel may still be using the buffers of slots in use, so wait for their completions
    /// before they (and the ring) are freed. Reached when the handle is gone and the reaper task
    /// ended or was dropped with its runtime.
    fn drop(&mut self) {
        let mut done = Vec::new();
        while self.lock().in_flight() > 0 {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(error) if is_transient(&error) => {}
                Err(error) => {
                    // Freeing the buffers could let the kernel write into reused memory, so
                    // they are leaked instead.
                    eprintln!("pocketflow: io_uring_enter failed at close: {error}");
                    let state = self.state.get_mut().expect("io_uring state lock poisoned");
                    std::mem::forget(std::mem::take(&mut state.slots));
                    return;
                }
            }
            self.reap(&mut done);
        }
    }
}

fn is_transient(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
    )
}

/// Release what the kernel no longer needs and send the completion (a caller that stopped
/// waiting dropped its receiver; its buffer is freed here).
fn complete(submission: Submission, result: i32) {
    let Submission { request, reply } = submission;
    let IoRequest {
        buf,
        permit,
        keep_alive,
        ..
    } = request;
    drop(keep_alive);
    let result = if result < 0 {
        Err(io::Error::from_raw_os_error(-result))
    } else {
        Ok(result as usize)
    };
    let _ = reply.send(IoCompletion {
        result,
        buf,
        permit,
    });
}

/// The reaper's view of the eventfd; it keeps the ring (and so the fd) alive while registered.
struct WakeFd(Arc<RingShared>);

impl AsRawFd for WakeFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.wake_fd.as_raw_fd()
    }
}

/// Reap completions whenever the eventfd fires, until the handle is dropped and no I/O is left.
async fn reap_until_closed(wake: AsyncFd<WakeFd>) {
    let shared = Arc::clone(&wake.get_ref().0);
    let mut done = Vec::with_capacity(shared.lock().slots.len());
    loop {
        let Ok(mut ready) = wake.readable().await else {
            // The runtime is shutting down; the ring's drop waits for what is in flight.
            return;
        };
        // Reset the counter before reaping, so a completion posted while we reap fires again.
        drain(&shared.wake_fd);
        ready.clear_ready();
        shared.reap(&mut done);
        if shared.closed.load(Ordering::SeqCst) && shared.lock().in_flight() == 0 {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs::OpenOptions;
    use std::os::unix::fs::OpenOptionsExt;
    use std::time::Duration;

    use super::*;
    use crate::engine::buffer::IO_ALIGN_BYTES;

    const PAGES: usize = 256;

    /// A file of `PAGES` pages opened for direct I/O, in a fresh directory.
    fn direct_file() -> (tempfile::TempDir, Arc<File>) {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(dir.path().join("ring"))
            .unwrap();
        file.set_len((PAGES * IO_ALIGN_BYTES) as u64).unwrap();
        (dir, Arc::new(file))
    }

    fn request(kind: IoKind, page: usize, fill: u8) -> IoRequest {
        let mut buf = AlignedBuf::zeroed(IO_ALIGN_BYTES);
        buf.fill(fill);
        IoRequest {
            kind,
            file_offset: (page * IO_ALIGN_BYTES) as u64,
            buf,
            permit: None,
            keep_alive: None,
        }
    }

    /// Wait (at most 5 s) until no slot is in use and every slot permit is back.
    async fn settle(uring: &Uring, depth: usize) {
        for _ in 0..5000 {
            let idle = uring.shared.lock().in_flight() == 0;
            if idle && uring.shared.slots_free.available_permits() == depth {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("slots still in use after 5 s");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_concurrent_ios_complete_within_the_queue_depth() {
        const DEPTH: u32 = 4;
        let (_dir, file) = direct_file();
        let uring = Arc::new(Uring::start(file, DEPTH).unwrap());
        // Far more callers than slots, each writing its own page and reading it back.
        let tasks: Vec<_> = (0..PAGES)
            .map(|page| {
                let uring = Arc::clone(&uring);
                tokio::spawn(async move {
                    let fill = page as u8 ^ 0x5a;
                    let written = uring.run(request(IoKind::Write, page, fill)).await.unwrap();
                    assert_eq!(written.result.unwrap(), IO_ALIGN_BYTES);
                    let read = uring.run(request(IoKind::Read, page, 0)).await.unwrap();
                    assert_eq!(read.result.unwrap(), IO_ALIGN_BYTES);
                    assert!(read.buf.iter().all(|&b| b == fill), "page {page} read back");
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let high_water = uring.in_flight_high_water();
        assert!(
            (1..=DEPTH as usize).contains(&high_water),
            "{high_water} operations in the kernel at once with a queue depth of {DEPTH}"
        );
        settle(&uring, DEPTH as usize).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cancelled_callers_lose_no_slot() {
        const DEPTH: u32 = 2;
        let (_dir, file) = direct_file();
        let uring = Arc::new(Uring::start(file, DEPTH).unwrap());
        // Callers dropped while waiting for a slot, and after submitting (their buffers stay in
        // the ring until the kernel is done).
        let tasks: Vec<_> = (0..64)
            .map(|page| {
                let uring = Arc::clone(&uring);
                tokio::spawn(async move { uring.run(request(IoKind::Read, page, 0)).await })
            })
            .collect();
        tokio::task::yield_now().await;
        for task in &tasks {
            task.abort();
        }
        for task in tasks {
            let _ = task.await;
        }
        settle(&uring, DEPTH as usize).await;
        let after = uring.run(request(IoKind::Write, 0, 7)).await.unwrap();
        assert_eq!(after.result.unwrap(), IO_ALIGN_BYTES);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_ring_ends_its_reaper_after_in_flight_io() {
        let (_dir, file) = direct_file();
        let uring = Uring::start(file, 8).unwrap();
        let ring = Arc::downgrade(&uring.shared);
        let mut pending = Vec::new();
        for page in 0..8 {
            pending.push(uring.submit(request(IoKind::Write, page, 1)).await.unwrap());
        }
        drop(uring);
        for completion in pending {
            assert_eq!(completion.await.unwrap().result.unwrap(), IO_ALIGN_BYTES);
        }
        for _ in 0..5000 {
            if ring.upgrade().is_none() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("the reaper kept the ring alive after close");
    }

    #[test]
    fn runtime_shutdown_with_io_in_flight_waits_for_the_kernel() {
        let (_dir, file) = direct_file();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let uring = runtime.block_on(async {
            let uring = Uring::start(file, 8).unwrap();
            for page in 0..8 {
                // Receivers dropped at once: only the ring owns these buffers now.
                drop(uring.submit(request(IoKind::Write, page, 2)).await.unwrap());
            }
            uring
        });
        // The reaper dies with the runtime; the last owner must wait for the kernel before
        // freeing the buffers (this would be a use-after-free under the kernel otherwise).
        drop(runtime);
        drop(uring);
    }
}
