//! One tokio runtime per process, made on first use and made again in a forked child.
//!
//! A child of `fork()` has only the forking thread: the parent's runtime threads do not exist
//! there, so the child must neither use nor drop the parent's runtime (dropping would wait for
//! threads that never end). The runtime remembers the pid it was made in; a call from another
//! pid makes a new one. Runtimes are never dropped (one per process that used the client), and
//! finding the current one takes no lock, so a fork while another thread is in a call cannot
//! leave the child waiting on a lock held by a thread that no longer exists.

use std::future::Future;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU8, Ordering};

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
    let pid = process_id();
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

/// This process's id, kept after the first call instead of asked of the kernel on every call
/// (every operation checks it a few times, to refuse a forked child its parent's connections).
/// A fork handler forgets it in the child; until that handler is registered, nothing is kept.
pub(crate) fn process_id() -> u32 {
    if PID_HOOK.load(Ordering::Acquire) == PID_HOOK_REGISTERED {
        let pid = PID.load(Ordering::Relaxed);
        if pid != 0 {
            return pid;
        }
        let pid = std::process::id();
        PID.store(pid, Ordering::Relaxed);
        return pid;
    }
    // The first caller registers the handler; nobody waits for it (a child forked meanwhile
    // keeps asking the kernel, which is always right).
    if PID_HOOK
        .compare_exchange(0, PID_HOOK_REGISTERING, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
    {
        // SAFETY: registers a handler that only stores to an atomic, which is async-signal-safe.
        let registered = unsafe { libc::pthread_atfork(None, None, Some(forget_pid)) } == 0;
        if registered {
            PID_HOOK.store(PID_HOOK_REGISTERED, Ordering::Release);
        }
    }
    std::process::id()
}

/// The kept process id (0: not known yet).
static PID: AtomicU32 = AtomicU32::new(0);
/// 0: no fork handler yet; `PID_HOOK_REGISTERING`: one is being registered;
/// `PID_HOOK_REGISTERED`: a fork forgets the kept id in the child.
static PID_HOOK: AtomicU8 = AtomicU8::new(0);
const PID_HOOK_REGISTERING: u8 = 1;
const PID_HOOK_REGISTERED: u8 = 2;

/// Run in the child of every `fork()`, before it returns there.
extern "C" fn forget_pid() {
    PID.store(0, Ordering::Relaxed);
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

    #[test]
    fn the_kept_process_id_is_the_kernels_and_a_child_forgets_it() {
        for _ in 0..3 {
            assert_eq!(process_id(), std::process::id());
        }
        // SAFETY: the child only calls async-signal-safe functions and getpid, then exits.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork failed");
        if child == 0 {
            let ok = process_id() == std::process::id() && process_id() != 0;
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just made.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "{status}"
        );
    }
}
