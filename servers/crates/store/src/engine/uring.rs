//! The io_uring submission thread: one per NVMe engine, fed by a bounded channel.
//!
//! Async callers send an [`IoRequest`] that owns its buffer (so a cancelled caller can never
//! leave the kernel writing into freed memory) and wait on a oneshot for the [`IoCompletion`].
//! The thread keeps at most `queue_depth` operations in the kernel; beyond that, requests wait in
//! the channel and then senders wait for channel space. The thread sleeps in
//! `io_uring_enter` and is woken by completions or, when idle, by an eventfd that senders write
//! and that the ring polls.

use std::any::Any;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;

use io_uring::{opcode, types, IoUring};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit};

use super::buffer::AlignedBuf;
use crate::error::StoreError;

/// Requests that may wait in the channel beyond those in the kernel, per queue-depth slot.
const CHANNEL_SLOTS_PER_DEPTH: usize = 2;
/// `user_data` of the eventfd poll, distinct from every slot index.
const WAKE_USER_DATA: u64 = u64::MAX;

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
    /// Keeps the target extent allocated until the kernel is done with it; dropped by the I/O
    /// thread before the completion is sent.
    pub keep_alive: Option<Box<dyn Any + Send>>,
}

/// The outcome of an [`IoRequest`], with its buffer and permit returned.
pub(crate) struct IoCompletion {
    pub result: io::Result<usize>,
    pub buf: AlignedBuf,
    pub permit: Option<OwnedSemaphorePermit>,
}

struct Submission {
    request: IoRequest,
    reply: oneshot::Sender<IoCompletion>,
}

/// Handle to the I/O thread; dropping the last handle stops it once in-flight I/O completes.
pub(crate) struct Uring {
    tx: Option<mpsc::Sender<Submission>>,
    wake_fd: Arc<OwnedFd>,
    sleeping: Arc<AtomicBool>,
}

impl Uring {
    /// Start the I/O thread for `file` with at most `queue_depth` operations in the kernel.
    pub fn start(file: Arc<File>, queue_depth: u32) -> Result<Self, StoreError> {
        assert!(queue_depth >= 1, "queue depth must be positive");
        // SAFETY: eventfd takes no pointers; a non-negative result is a fresh fd we own.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(StoreError::Io {
                op: "eventfd",
                path: None,
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: `raw` is a valid fd that nothing else owns.
        let wake_fd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        let channel_slots = queue_depth as usize * CHANNEL_SLOTS_PER_DEPTH;
        let (tx, rx) = mpsc::channel(channel_slots);
        let sleeping = Arc::new(AtomicBool::new(false));
        let ring_entries = (queue_depth + 1).next_power_of_two();
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let worker_wake_fd = Arc::clone(&wake_fd);
        let worker_sleeping = Arc::clone(&sleeping);
        thread::Builder::new()
            .name("pocketflow-uring".into())
            .spawn(move || {
                let ring = match open_ring(ring_entries) {
                    Ok(ring) => ring,
                    Err(error) => {
                        let _ = ready_tx.send(Err(error));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                let worker = Worker {
                    ring,
                    file,
                    rx,
                    wake_fd: worker_wake_fd,
                    sleeping: worker_sleeping,
                    slots: (0..queue_depth).map(|_| None).collect(),
                    free_slots: (0..queue_depth as usize).rev().collect(),
                };
                worker.run();
            })
            .map_err(|source| StoreError::Io {
                op: "spawn io_uring thread",
                path: None,
                source,
            })?;
        let ready = ready_rx
            .recv()
            .unwrap_or_else(|_| Err(io::Error::other("io_uring thread died at start")));
        ready.map_err(|source| StoreError::Io {
            op: "io_uring setup",
            path: None,
            source,
        })?;
        Ok(Self {
            tx: Some(tx),
            wake_fd,
            sleeping,
        })
    }

    /// Queue `request` (waiting for channel space) and return the receiver of its completion.
    pub async fn submit(
        &self,
        request: IoRequest,
    ) -> Result<oneshot::Receiver<IoCompletion>, StoreError> {
        let (reply, completion) = oneshot::channel();
        let tx = self.tx.as_ref().ok_or(StoreError::EngineStopped)?;
        tx.send(Submission { request, reply })
            .await
            .map_err(|_| StoreError::EngineStopped)?;
        // Pairs with the fence in `Worker::run`: either the worker sees the request before it
        // sleeps, or we see it sleeping and wake it.
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            wake(&self.wake_fd);
        }
        Ok(completion)
    }

    /// Submit `request` and wait for its completion.
    pub async fn run(&self, request: IoRequest) -> Result<IoCompletion, StoreError> {
        let completion = self.submit(request).await?;
        completion.await.map_err(|_| StoreError::EngineStopped)
    }
}

impl Drop for Uring {
    fn drop(&mut self) {
        drop(self.tx.take());
        wake(&self.wake_fd);
    }
}

/// Create the ring on the thread that will use it. Only this thread submits, so the kernel may
/// defer completion work until the thread waits for completions (no interrupting IPIs); kernels
/// before 6.1 lack these flags and get a plain ring.
fn open_ring(entries: u32) -> io::Result<IoUring> {
    IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(entries)
        .or_else(|_| IoUring::new(entries))
}

fn wake(fd: &OwnedFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writing 8 bytes from a live buffer to our eventfd. A full counter (EAGAIN) already
    // means "awake", so the result needs no handling.
    unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
}

/// The I/O thread's state; the ring is created on, and used only by, this thread.
struct Worker {
    ring: IoUring,
    file: Arc<File>,
    rx: mpsc::Receiver<Submission>,
    wake_fd: Arc<OwnedFd>,
    sleeping: Arc<AtomicBool>,
    slots: Vec<Option<Submission>>,
    free_slots: Vec<usize>,
}

impl Worker {
    fn run(mut self) {
        let mut closed = false;
        self.arm_wake_poll();
        loop {
            while !closed && !self.free_slots.is_empty() {
                match self.rx.try_recv() {
                    Ok(submission) => self.push(submission),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => closed = true,
                }
            }
            let in_flight = self.slots.len() - self.free_slots.len();
            if closed && in_flight == 0 {
                return;
            }
            if !closed && !self.free_slots.is_empty() {
                self.sleeping.store(true, Ordering::SeqCst);
                fence(Ordering::SeqCst);
                if !self.rx.is_empty() || self.rx.is_closed() {
                    self.sleeping.store(false, Ordering::SeqCst);
                    continue;
                }
            }
            let entered = self.ring.submit_and_wait(1);
            self.sleeping.store(false, Ordering::SeqCst);
            match entered.map_err(|e| e.raw_os_error()) {
                Ok(_) | Err(Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {}
                Err(_) => {
                    // Unwinding would free buffers the kernel may still be writing into, so a
                    // ring that cannot be entered any more ends the process instead.
                    eprintln!(
                        "pocketflow: io_uring_enter failed: {}",
                        io::Error::last_os_error()
                    );
                    std::process::abort();
                }
            }
            self.reap();
        }
    }

    fn arm_wake_poll(&mut self) {
        let poll = opcode::PollAdd::new(types::Fd(self.wake_fd.as_raw_fd()), libc::POLLIN as u32)
            .build()
            .user_data(WAKE_USER_DATA);
        // SAFETY: the poll references only the eventfd, which this worker keeps open.
        unsafe { self.ring.submission().push(&poll) }
            .expect("submission queue has room for the wake poll");
    }

    fn push(&mut self, mut submission: Submission) {
        let slot = self.free_slots.pop().expect("a free slot");
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
        let entry = entry.user_data(slot as u64);
        // SAFETY: the buffer is owned by the submission, which stays in `slots` (its heap memory
        // does not move) until the completion is reaped; the file stays open while we run.
        unsafe { self.ring.submission().push(&entry) }
            .expect("submission queue larger than the queue depth");
        self.slots[slot] = Some(submission);
    }

    fn reap(&mut self) {
        let mut rearm = false;
        let mut done = Vec::new();
        for entry in self.ring.completion() {
            if entry.user_data() == WAKE_USER_DATA {
                rearm = true;
            } else {
                done.push((entry.user_data() as usize, entry.result()));
            }
        }
        for (slot, result) in done {
            let Submission { request, reply } =
                self.slots[slot].take().expect("completion of a used slot");
            self.free_slots.push(slot);
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
            // A caller that stopped waiting drops the receiver; its buffer is freed here.
            let _ = reply.send(IoCompletion {
                result,
                buf,
                permit,
            });
        }
        if rearm {
            let mut counter = [0u8; 8];
            // SAFETY: reading 8 bytes into a live buffer from our non-blocking eventfd.
            unsafe {
                libc::read(
                    self.wake_fd.as_raw_fd(),
                    counter.as_mut_ptr().cast(),
                    counter.len(),
                )
            };
            self.arm_wake_poll();
        }
    }
}
