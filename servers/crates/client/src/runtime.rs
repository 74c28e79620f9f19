//! One tokio runtime per process, made on first use and made again in a forked child.
//!
//! A child of `fork()` has only the forking thread: the parent's runtime threads do not exist
//! there, so the child must neither use nor drop the parent's runtime (dropping would wait for
//! threads that never end). The runtime remembers the pid it was made in; a call from another
//! pid makes a new one. Runtimes are never dropped (one per process that used the client), and
//! finding the current one takes no lock, so a fork while another thread is in a call cannot
//! leave the child waiting on a lock held by a thread that no longer exists.

use std::future::Future;
use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};

use tokio::runtime::{Builder, Handle, Runtime};

/// Worker threads of the client runtime: they run the HTTP/2 connections; the calling threads
/// drive their own requests (see [`block_on`]).
const RUNTIME_WORKER_THREADS: usize = 2;

struct ProcessRuntime {
    pid: u32,
    runtime: Runtime,
}

static CURRENT: AtomicPtr<ProcessRuntime> = AtomicPtr::new(std::ptr::null_mut());
/// The pid of the process whose thread is making a runtime now (0: nobody).
static MAKER_PID: AtomicU32 = AtomicU32::new(0);

fn find(pid: u32) -> Option<&'static Runtime> {
    let current = CURRENT.load(Ordering::Acquire);
    if current.is_null() {
        return None;
    }
    // SAFETY: every ProcessRuntime stored is leaked, so the pointer stays valid for good.
    let found: &'static ProcessRuntime = unsafe { &*current };
    (found.pid == pid).then_some(&found.runtime)
}

fn current() -> &'static Runtime {
    let pid = std::process::id();
    if let Some(runtime) = find(pid) {
        return runtime;
    }
    // Slow path, once per process: one thread makes the runtime. A maker whose pid is not ours
    // was a thread of the parent caught mid-make by fork(): it does not exist here.
    loop {
        let maker = MAKER_PID.load(Ordering::Acquire);
        if maker == pid {
            std::thread::yield_now();
        } else if MAKER_PID
            .compare_exchange(maker, pid, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            break;
        }
        if let Some(runtime) = find(pid) {
            return runtime;
        }
    }
    let runtime = match find(pid) {
        Some(runtime) => runtime,
        None => {
            let made = Builder::new_multi_thread()
                .worker_threads(RUNTIME_WORKER_THREADS)
                .thread_name("pocketflow-io")
                .enable_all()
                .build()
                .expect("the client runtime starts (threads and an epoll instance)");
            let leaked: &'static mut ProcessRuntime =
                Box::leak(Box::new(ProcessRuntime { pid, runtime: made }));
            // The parent's runtime, if any, is left as it is: never used or dropped here.
            CURRENT.store(leaked, Ordering::Release);
            &leaked.runtime
        }
    };
    MAKER_PID.store(0, Ordering::Release);
    runtime
}

/// A handle to this process's client runtime.
pub fn runtime_handle() -> Handle {
    current().handle().clone()
}

/// Run `future` to completion on the calling thread, with the runtime's I/O and timers.
pub fn block_on<F: Future>(future: F) -> F::Output {
    current().block_on(future)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_runtime_per_process() {
        let a = current() as *const Runtime;
        let b = std::thread::spawn(|| current() as *const Runtime as usize)
            .join()
            .unwrap();
        assert_eq!(a as usize, b);
        assert_eq!(block_on(async { 6 * 7 }), 42);
    }
}
