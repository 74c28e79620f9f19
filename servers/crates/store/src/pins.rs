//! The pin table: the object bytes that readers on this host read in place from the shared DRAM
//! arena, held for the process that pinned them until it unpins them or is gone.
//!
//! A pin holds the `Bytes` of a read, so the block's extent (and its charge to the job, as for
//! any read in flight) stays until the pin goes, whatever happens to the object meanwhile. A
//! pin belongs to a process, named by its pid and start time (`/proc/<pid>/stat` field 22): a
//! sweep releases the pins of a process that is gone (or whose pid now names another process).
//! There is no lease: a stopped process keeps its pins, since its views would otherwise read
//! reused memory. Every dimension is bounded: bytes over all jobs, bytes per job, pins per
//! process; a pin over a bound is refused and the reader copies the object instead.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::error::StoreError;

/// The bounds of a [`PinTable`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinBounds {
    /// Most bytes pinned over all jobs.
    pub bytes_max: u64,
    /// Most bytes pinned by one job.
    pub job_bytes_max: u64,
    /// Most pins of one process.
    pub process_pins_max: u32,
}

/// Counters of a [`PinTable`], for stats and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinCounts {
    /// Pins held now.
    pub pins: u64,
    /// Bytes they hold.
    pub bytes: u64,
    /// Pins granted since the start.
    pub granted: u64,
    /// Pins refused at a bound since the start.
    pub refused: u64,
    /// Pins released by the sweep (their process was gone) since the start.
    pub swept: u64,
    /// Pinning processes whose start time a sweep could not read (their pins kept) since the
    /// start.
    pub sweep_errors: u64,
}

struct Pin {
    job: Arc<str>,
    pid: u32,
    bytes: Bytes,
}

struct Process {
    start_time: u64,
    pins: HashSet<u64>,
}

#[derive(Default)]
struct Inner {
    pins: HashMap<u64, Pin>,
    processes: HashMap<u32, Process>,
    job_bytes: HashMap<Arc<str>, u64>,
    bytes: u64,
    granted: u64,
    refused: u64,
    swept: u64,
    sweep_errors: u64,
}

impl Inner {
    /// Remove pin `id`, returning its bytes (dropped by the caller, outside the lock).
    fn remove(&mut self, id: u64) -> Option<Bytes> {
        let pin = self.pins.remove(&id)?;
        let len = pin.bytes.len() as u64;
        self.bytes -= len;
        if let Some(left) = self.job_bytes.get_mut(&pin.job) {
            *left -= len;
            if *left == 0 {
                self.job_bytes.remove(&pin.job);
            }
        }
        if let Some(process) = self.processes.get_mut(&pin.pid) {
            process.pins.remove(&id);
            if process.pins.is_empty() {
                self.processes.remove(&pin.pid);
            }
        }
        Some(pin.bytes)
    }

    /// Remove every pin of process `pid`.
    fn remove_process(&mut self, pid: u32) -> Vec<Bytes> {
        let ids: Vec<u64> = self
            .processes
            .get(&pid)
            .map(|p| p.pins.iter().copied().collect())
            .unwrap_or_default();
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }
}

/// A random first pin id (in `1..2^62`), so that the ids of a server restarted at the same
/// address are not those of the one before: an UNPIN of a pin of the earlier server (a reader's
/// view outliving it) then names no pin of the new one, instead of a live reader's.
fn first_pin_id() -> u64 {
    let mut raw = [0u8; 8];
    // SAFETY: writing at most `raw.len()` bytes into `raw`.
    let got = unsafe { libc::getrandom(raw.as_mut_ptr().cast(), raw.len(), 0) };
    let random = if got == raw.len() as isize {
        u64::from_le_bytes(raw)
    } else {
        // No kernel randomness: the clock's nanoseconds still differ between two starts.
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    };
    (random >> 2).max(1)
}

/// Pins of one server, shared by its request handlers and its sweep.
pub struct PinTable {
    bounds: PinBounds,
    inner: Mutex<Inner>,
    next_id: AtomicU64,
}

impl PinTable {
    /// An empty table with `bounds`.
    pub fn new(bounds: PinBounds) -> Self {
        Self {
            bounds,
            inner: Mutex::new(Inner::default()),
            next_id: AtomicU64::new(first_pin_id()),
        }
    }

    /// The table's bounds.
    pub fn bounds(&self) -> PinBounds {
        self.bounds
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("pin table lock poisoned")
    }

    /// Hold `bytes` for process `pid` (started at `start_time`) of `job`; returns the pin's id,
    /// or `PinBound` (nothing held). Pins of an earlier process with the same pid are released
    /// first: that process is gone.
    pub fn pin(
        &self,
        job: &str,
        pid: u32,
        start_time: u64,
        bytes: Bytes,
    ) -> Result<u64, StoreError> {
        let len = bytes.len() as u64;
        let mut released = Vec::new();
        let mut inner = self.lock();
        if inner
            .processes
            .get(&pid)
            .is_some_and(|p| p.start_time != start_time)
        {
            released = inner.remove_process(pid);
            inner.swept += released.len() as u64;
        }
        let process_pins = inner.processes.get(&pid).map_or(0, |p| p.pins.len());
        let job_bytes = inner.job_bytes.get(job).copied().unwrap_or(0);
        let refusal = if process_pins >= self.bounds.process_pins_max as usize {
            Some((
                "pins of the process",
                u64::from(self.bounds.process_pins_max),
            ))
        } else if job_bytes + len > self.bounds.job_bytes_max {
            Some(("job pinned bytes", self.bounds.job_bytes_max))
        } else if inner.bytes + len > self.bounds.bytes_max {
            Some(("server pinned bytes", self.bounds.bytes_max))
        } else {
            None
        };
        if let Some((what, max)) = refusal {
            inner.refused += 1;
            drop(inner);
            drop(released);
            return Err(StoreError::PinBound { what, max });
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let job: Arc<str> = match inner.job_bytes.get_key_value(job) {
            Some((name, _)) => Arc::clone(name),
            None => job.into(),
        };
        *inner.job_bytes.entry(Arc::clone(&job)).or_insert(0) += len;
        inner.bytes += len;
        inner.granted += 1;
        inner
            .processes
            .entry(pid)
            .or_insert_with(|| Process {
                start_time,
                pins: HashSet::new(),
            })
            .pins
            .insert(id);
        inner.pins.insert(id, Pin { job, pid, bytes });
        drop(inner);
        drop(released);
        Ok(id)
    }

    /// Release pin `id` if `job`'s process `pid` holds it; returns whether it did.
    pub fn unpin(&self, job: &str, pid: u32, id: u64) -> bool {
        let mut inner = self.lock();
        let owned = inner
            .pins
            .get(&id)
            .is_some_and(|pin| pin.pid == pid && &*pin.job == job);
        let bytes = if owned { inner.remove(id) } else { None };
        drop(inner);
        bytes.is_some()
    }

    /// Release the pins of every process that `start_time_of` no longer finds with the start
    /// time it pinned under (`Ok(None)`: no such process; `Ok(Some(t))` with another start
    /// time: the pid names a later process); returns how many pins went. A process whose start
    /// time cannot be read (`Err`: out of descriptors or memory, refused) keeps its pins: it may
    /// be alive, and its views would read reused memory; such reads are counted
    /// ([`PinCounts::sweep_errors`]).
    pub fn sweep(&self, start_time_of: impl Fn(u32) -> std::io::Result<Option<u64>>) -> usize {
        let processes: Vec<(u32, u64)> = {
            let inner = self.lock();
            inner
                .processes
                .iter()
                .map(|(pid, p)| (*pid, p.start_time))
                .collect()
        };
        // The process table is read without the lock held.
        let mut errors = 0u64;
        let gone: Vec<(u32, u64)> = processes
            .into_iter()
            .filter(|(pid, start)| match start_time_of(*pid) {
                Ok(seen) => seen != Some(*start),
                Err(_) => {
                    errors += 1;
                    false
                }
            })
            .collect();
        if gone.is_empty() {
            if errors > 0 {
                self.lock().sweep_errors += errors;
            }
            return 0;
        }
        let mut inner = self.lock();
        inner.sweep_errors += errors;
        let mut released = Vec::new();
        for (pid, start) in gone {
            // Pinned again meanwhile by a new process of that pid: that one is alive.
            if inner
                .processes
                .get(&pid)
                .is_some_and(|p| p.start_time == start)
            {
                released.extend(inner.remove_process(pid));
            }
        }
        inner.swept += released.len() as u64;
        drop(inner);
        released.len()
    }

    /// The table's counters now.
    pub fn counts(&self) -> PinCounts {
        let inner = self.lock();
        PinCounts {
            pins: inner.pins.len() as u64,
            bytes: inner.bytes,
            granted: inner.granted,
            refused: inner.refused,
            swept: inner.swept,
            sweep_errors: inner.sweep_errors,
        }
    }

    /// Bytes `job` has pinned now.
    pub fn job_bytes(&self, job: &str) -> u64 {
        self.lock().job_bytes.get(job).copied().unwrap_or(0)
    }
}

/// The start time of process `pid` (field 22 of `/proc/<pid>/stat`, clock ticks since boot):
/// `Ok(None)` if there is no such process here (`ENOENT`, `ESRCH`: gone, or in another pid
/// namespace), `Err` if it could not be read otherwise (out of descriptors or memory, refused,
/// unparsable), which says nothing of whether it lives.
pub fn process_start_time(pid: u32) -> std::io::Result<Option<u64>> {
    let stat = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Ok(None),
        Err(e) => return Err(e),
    };
    let unparsable = || std::io::Error::new(std::io::ErrorKind::InvalidData, "bad /proc stat");
    // The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    let after_name = &stat[stat.rfind(')').ok_or_else(unparsable)? + 1..];
    // Field 3 is the first after the name; field 22 is the 20th from there.
    let field = after_name
        .split_whitespace()
        .nth(19)
        .ok_or_else(unparsable)?;
    field.parse().map(Some).map_err(|_| unparsable())
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: PinBounds = PinBounds {
        bytes_max: 1000,
        job_bytes_max: 600,
        process_pins_max: 3,
    };

    fn bytes(len: usize) -> Bytes {
        Bytes::from(vec![7u8; len])
    }

    #[test]
    fn pins_are_bounded_per_process_per_job_and_per_server() {
        let table = PinTable::new(BOUNDS);
        for _ in 0..3 {
            table.pin("a", 10, 1, bytes(10)).unwrap();
        }
        assert!(matches!(
            table.pin("a", 10, 1, bytes(10)),
            Err(StoreError::PinBound {
                what: "pins of the process",
                max: 3
            })
        ));
        table.pin("a", 11, 1, bytes(500)).unwrap();
        assert!(matches!(
            table.pin("a", 12, 1, bytes(100)),
            Err(StoreError::PinBound {
                what: "job pinned bytes",
                max: 600
            })
        ));
        table.pin("b", 12, 1, bytes(400)).unwrap();
        assert!(matches!(
            table.pin("c", 13, 1, bytes(100)),
            Err(StoreError::PinBound {
                what: "server pinned bytes",
                max: 1000
            })
        ));
        let counts = table.counts();
        assert_eq!((counts.pins, counts.bytes, counts.refused), (5, 930, 3));
    }

    #[test]
    fn only_the_owner_unpins_and_the_bytes_stay_until_then() {
        let table = PinTable::new(BOUNDS);
        let held = bytes(100);
        let id = table.pin("a", 10, 5, held.clone()).unwrap();
        assert!(!table.unpin("b", 10, id), "another job's unpin is ignored");
        assert!(
            !table.unpin("a", 11, id),
            "another process's unpin is ignored"
        );
        assert_eq!(table.job_bytes("a"), 100);
        assert!(table.unpin("a", 10, id));
        assert!(!table.unpin("a", 10, id), "a pin goes once");
        assert_eq!(table.counts().bytes, 0);
        assert_eq!(table.job_bytes("a"), 0);
    }

    #[test]
    fn the_sweep_releases_gone_processes_and_keeps_live_ones() {
        let table = PinTable::new(BOUNDS);
        table.pin("a", 10, 5, bytes(10)).unwrap();
        table.pin("a", 10, 5, bytes(10)).unwrap();
        table.pin("a", 11, 6, bytes(10)).unwrap();
        table.pin("a", 12, 7, bytes(10)).unwrap();
        // 10 is gone, 11 is alive, 12's pid now names a process started later.
        let swept = table.sweep(|pid| {
            Ok(match pid {
                11 => Some(6),
                12 => Some(8),
                _ => None,
            })
        });
        assert_eq!(swept, 3);
        let counts = table.counts();
        assert_eq!((counts.pins, counts.bytes, counts.swept), (1, 10, 3));
        // A new process with a reused pid releases the old one's pins when it pins.
        table.pin("a", 11, 9, bytes(10)).unwrap();
        assert_eq!(table.counts().pins, 1);
    }

    #[test]
    fn a_process_whose_start_time_cannot_be_read_keeps_its_pins() {
        let table = PinTable::new(BOUNDS);
        table.pin("a", 10, 5, bytes(10)).unwrap();
        table.pin("a", 11, 6, bytes(10)).unwrap();
        // 10's /proc read fails with EMFILE, 11's with EACCES: neither says it is gone.
        let swept = table.sweep(|pid| {
            Err(std::io::Error::from_raw_os_error(match pid {
                10 => libc::EMFILE,
                _ => libc::EACCES,
            }))
        });
        assert_eq!(swept, 0);
        let counts = table.counts();
        assert_eq!((counts.pins, counts.swept, counts.sweep_errors), (2, 0, 2));
        // Once the read says there is no such process, its pins go.
        let swept = table.sweep(|pid| Ok((pid == 11).then_some(6)));
        assert_eq!(swept, 1);
        assert_eq!(table.counts().pins, 1);
    }

    #[test]
    fn pin_ids_differ_between_tables() {
        // A restarted server's ids are not its predecessor's (a stale UNPIN names none of them).
        let first = PinTable::new(BOUNDS).pin("a", 10, 5, bytes(1)).unwrap();
        let second = PinTable::new(BOUNDS).pin("a", 10, 5, bytes(1)).unwrap();
        assert_ne!(first, second);
        assert!(first >= 1 && second >= 1);
    }

    #[test]
    fn start_times_come_from_procfs() {
        let own = process_start_time(std::process::id())
            .unwrap()
            .expect("this process is visible");
        assert_eq!(process_start_time(std::process::id()).unwrap(), Some(own));
        let mut child = std::process::Command::new("sleep")
            .arg("10")
            .spawn()
            .unwrap();
        let pid = child.id();
        let started = process_start_time(pid)
            .unwrap()
            .expect("the child is visible");
        assert!(started >= own);
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(
            process_start_time(pid).unwrap(),
            None,
            "a reaped child is gone"
        );
    }
}
