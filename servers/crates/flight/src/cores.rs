//! Vertical scaling: how many CPU cores the server process runs on, changed while it runs.
//!
//! The runtime keeps its worker threads (`--threads`); `set_cores` sets the CPU affinity of
//! every thread of the process (`/proc/self/task`) to the first `n` of the cores the process was
//! allowed when it started, so at most `n` cores run server code at once and DRAM data is kept.
//! Threads started later inherit the affinity of the thread that starts them. The affinity is a
//! property of the process, so this state is process-wide.

use std::sync::{Mutex, OnceLock};

/// Most CPU cores tracked (the size of the kernel's `cpu_set_t`).
pub const CORES_TRACKED_MAX: usize = libc::CPU_SETSIZE as usize;

/// Passes over `/proc/self/task`, so a thread started during the first pass is caught by the
/// next (threads are started rarely: the blocking pool grows only under load).
const AFFINITY_PASSES: usize = 2;

/// Why the cores could not be changed.
#[derive(Debug, thiserror::Error)]
pub enum CoresError {
    /// Asked for 0 cores or more than the process may use.
    #[error("cores must be in 1..={max}, got {asked}")]
    OutOfRange {
        /// The request.
        asked: usize,
        /// Cores the process was allowed at start.
        max: usize,
    },
    /// The kernel refused to change a thread's affinity.
    #[error("sched_setaffinity failed with errno {errno}")]
    Affinity {
        /// The OS error number.
        errno: i32,
    },
}

/// The cores the process may use and the cores it uses now.
#[derive(Debug)]
pub struct Cores {
    /// CPU ids the process was allowed at start, ascending.
    allowed: Vec<usize>,
    /// How many of `allowed` (a prefix) are in use; changes are serialized by the lock.
    current: Mutex<usize>,
    /// Runtime worker threads, for statistics.
    threads: usize,
}

static CORES: OnceLock<Cores> = OnceLock::new();

/// Record the process's allowed cores and its worker thread count; call once, at start.
pub fn init(threads: usize) -> &'static Cores {
    CORES.get_or_init(|| Cores::detect(threads))
}

/// The process's cores (detected on first use if `init` was not called).
pub fn get() -> &'static Cores {
    CORES.get_or_init(|| Cores::detect(0))
}

impl Cores {
    fn detect(threads: usize) -> Self {
        let allowed = allowed_cpus();
        let current = Mutex::new(allowed.len());
        Self {
            allowed,
            current,
            threads,
        }
    }

    /// Cores in use now.
    pub fn current(&self) -> usize {
        *self.current.lock().expect("cores lock poisoned")
    }

    /// Cores the process may be given at most.
    pub fn max(&self) -> usize {
        self.allowed.len()
    }

    /// Runtime worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run every thread of the process on the first `n` allowed cores; returns `n`.
    pub fn set(&self, n: usize) -> Result<usize, CoresError> {
        if n == 0 || n > self.allowed.len() {
            return Err(CoresError::OutOfRange {
                asked: n,
                max: self.allowed.len(),
            });
        }
        let mut current = self.current.lock().expect("cores lock poisoned");
        // SAFETY: cpu_set_t is plain data; CPU_ZERO and CPU_SET only write inside it.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        unsafe { libc::CPU_ZERO(&mut set) };
        for &cpu in &self.allowed[..n] {
            unsafe { libc::CPU_SET(cpu, &mut set) };
        }
        for _ in 0..AFFINITY_PASSES {
            for tid in thread_ids() {
                // SAFETY: `set` is a valid cpu_set_t of the size passed.
                let rc = unsafe {
                    libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set)
                };
                if rc != 0 {
                    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
                    // A thread that exited between listing and the call is not an error.
                    if errno != libc::ESRCH {
                        return Err(CoresError::Affinity { errno });
                    }
                }
            }
        }
        *current = n;
        Ok(n)
    }
}

/// CPU ids this process may run on now, ascending (at least one).
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data filled in by the kernel.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return vec![0];
    }
    let cpus: Vec<usize> = (0..CORES_TRACKED_MAX)
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect();
    if cpus.is_empty() {
        vec![0]
    } else {
        cpus
    }
}

/// Ids of the process's threads now.
fn thread_ids() -> Vec<libc::pid_t> {
    match std::fs::read_dir("/proc/self/task") {
        Ok(entries) => entries
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect(),
        // Without /proc, at least the calling thread is limited.
        Err(_) => vec![0],
    }
}

/// CPU ids a thread may run on, read back from the kernel (tests and diagnostics).
pub fn thread_affinity(tid: libc::pid_t) -> Vec<usize> {
    // SAFETY: as in allowed_cpus.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let rc =
        unsafe { libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Vec::new();
    }
    (0..CORES_TRACKED_MAX)
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cores_limit_every_thread_and_come_back() {
        let cores = Cores::detect(2);
        let max = cores.max();
        assert!(max >= 1);
        assert_eq!(cores.current(), max);
        assert!(matches!(
            cores.set(0),
            Err(CoresError::OutOfRange { asked: 0, .. })
        ));
        assert!(matches!(
            cores.set(max + 1),
            Err(CoresError::OutOfRange { .. })
        ));
        // A thread that exists before the change is limited too.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let worker = std::thread::spawn(move || {
            tid_tx.send(unsafe { libc::gettid() }).unwrap();
            rx.recv().unwrap();
        });
        let tid = tid_rx.recv().unwrap();
        assert_eq!(cores.set(1).unwrap(), 1);
        assert_eq!(cores.current(), 1);
        assert_eq!(thread_affinity(tid), cores.allowed[..1].to_vec());
        assert_eq!(thread_affinity(0), cores.allowed[..1].to_vec());
        assert_eq!(cores.set(max).unwrap(), max);
        assert_eq!(thread_affinity(tid), cores.allowed);
        tx.send(()).unwrap();
        worker.join().unwrap();
    }
}
