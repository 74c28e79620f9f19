//! Capacity accounting: the server-wide byte budget and per-job usage, charged by RAII guards.
//!
//! Every record and data block holds a [`Charge`] of its engine allocation plus a fixed index
//! overhead; the charge is released when the entry's last holder (the index, or a reader still
//! holding the bytes) drops it. The budget equals the engine's capacity, so `used_bytes` never
//! exceeds it and the index's memory is bounded by the capacity too.
//!
//! A slice of the budget, the *records' reserve* (1/64 of the capacity, at most 64 MiB), is
//! kept for records that carry no object data ([`ChargeKind::Record`]: a large object's
//! manifest, which may name the servers its blocks went to instead of this one). Data (small
//! objects' bytes, data blocks, queue items, append records) stops short of it. So a server whose
//! tier is full of data still takes the manifest of an object whose bytes a client wrote on
//! another tier, and readers, waiters and DELETE-on-read claims keep finding every key at its
//! home (docs/ARCHITECTURE.md, "Bigger than DRAM").
//!
//! A job may also hold a *reservation* here: the bytes of its reservation the control plane
//! packed on this server (`set_epoch`'s map, docs/PROTOCOL.md). A charge of a job is admitted if
//! the job stays within its reservation, or if the server's free bytes after it still cover
//! every other job's unused reservation (reserved less used, at least 0); else it is
//! `CapacityExhausted` with [`CapacityLimit::Reserved`], which a client treats as a full tier
//! (it overflows to the job's other servers). So one job writing beyond its reservation cannot
//! cost another the room reserved for it. Records (manifests) are held to the same rule against
//! the whole capacity, so they may use the records' reserve, which stays shared by all jobs: the
//! records of other jobs can take at most the reserve (1/64 of the capacity, at most 64 MiB)
//! out of a job's unused reservation. While at most one job holds a reservation and it is the
//! one charging, nothing is checked beyond the tier's limit, as without reservations.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{CapacityLimit, StoreError};
use crate::refusals::Refusals;

/// Bytes charged per index entry (record or data block) on top of its key length and engine
/// allocation, so that an unbounded number of empty objects cannot exhaust server memory: a
/// 0-byte object with a 10-byte key costs 74 bytes of the budget.
pub const INDEX_ENTRY_OVERHEAD_BYTES: u64 = 64;

/// The records' reserve is the capacity divided by this ...
pub const RECORD_RESERVE_DIVISOR: u64 = 64;
/// ... and at most this many bytes.
pub const RECORD_RESERVE_MAX_BYTES: u64 = 64 * 1024 * 1024;

/// The most jobs whose reservation's epoch the budget remembers (as many as the epoch table of
/// the service holds); beyond it a new job's reservation is set without its epoch remembered.
pub const RESERVATION_EPOCHS_MAX: usize = 65_536;

/// What a charge pays for, which decides how much of the budget it may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChargeKind {
    /// Object data: up to the capacity less the records' reserve.
    Data,
    /// A record without object data (a manifest): up to the whole capacity.
    Record,
}

/// The server-wide budget of chargeable bytes.
#[derive(Debug)]
pub(crate) struct Budget {
    capacity_bytes: u64,
    /// The records' reserve (see the module doc).
    reserve_bytes: u64,
    used_bytes: AtomicU64,
    reservations: Mutex<Reservations>,
    /// `reservations.held.len()`, read without the lock to take the fast path.
    reserving_jobs: AtomicUsize,
    /// Odd while `set_reservation` changes the reservations, bumped before and after, so that a
    /// lock-free charge can tell whether they changed between its check and its bytes being
    /// taken (see [`Budget::charge`]).
    reservations_version: AtomicU64,
    /// Serializes the charges that other jobs' reservations bound (see [`Budget::charge`]).
    admission: Mutex<()>,
    /// Charges and engine allocations refused since start, by the limit they hit.
    refusals: Refusals,
    /// A test's step inside a charge's lock-free check.
    #[cfg(test)]
    hook: TestHook,
}

/// A step a test runs once inside the next charge, between its reading of the number of jobs
/// holding a reservation and of its own reservation.
#[cfg(test)]
#[derive(Default)]
struct TestHook(Mutex<Option<TestStep>>);

#[cfg(test)]
type TestStep = Box<dyn FnOnce(&Budget) + Send>;

#[cfg(test)]
impl TestHook {
    fn set(&self, step: impl FnOnce(&Budget) + Send + 'static) {
        *self.0.lock().expect("hook lock poisoned") = Some(Box::new(step));
    }

    fn run(&self, budget: &Budget) {
        let step = self.0.lock().expect("hook lock poisoned").take();
        if let Some(step) = step {
            step(budget);
        }
    }
}

#[cfg(test)]
impl std::fmt::Debug for TestHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TestHook")
    }
}

/// The reservations held here, under [`Budget`]'s lock.
#[derive(Debug, Default)]
struct Reservations {
    /// The jobs holding a reservation here (each with `reserved_bytes` above 0), by job id.
    held: HashMap<String, Arc<JobAccount>>,
    /// The epoch of the map that last set each job's reservation (0 bytes too), by job id, so
    /// that a late retry of an older epoch's map cannot replace a newer one's; forgotten at the
    /// job's end. At most [`RESERVATION_EPOCHS_MAX`] jobs.
    epochs: HashMap<String, u64>,
}

/// Usage counters of one job; updated by charges and by the index.
#[derive(Debug, Default)]
pub(crate) struct JobAccount {
    /// Bytes charged to the job's entries, including entries only readers still hold.
    pub used_bytes: AtomicU64,
    /// Block-0 records in the index.
    pub objects: AtomicU64,
    /// Records and data blocks in the index.
    pub entries: AtomicU64,
    /// Of `entries`, the channels': queue and append-file segments, queue items and records.
    pub channel_entries: AtomicU64,
    /// The job's reservation on this server (0: none); see the module doc.
    pub reserved_bytes: AtomicU64,
    /// The job's charges and engine allocations refused, by the limit they hit.
    pub refusals: Refusals,
}

/// Bytes held against the budget and a job's usage; released on drop.
#[derive(Debug)]
pub(crate) struct Charge {
    bytes: u64,
    budget: Arc<Budget>,
    job: Arc<JobAccount>,
}

impl Budget {
    pub fn new(capacity_bytes: u64) -> Arc<Self> {
        Arc::new(Self {
            capacity_bytes,
            reserve_bytes: (capacity_bytes / RECORD_RESERVE_DIVISOR).min(RECORD_RESERVE_MAX_BYTES),
            used_bytes: AtomicU64::new(0),
            reservations: Mutex::new(Reservations::default()),
            reserving_jobs: AtomicUsize::new(0),
            reservations_version: AtomicU64::new(0),
            admission: Mutex::new(()),
            refusals: Refusals::default(),
            #[cfg(test)]
            hook: TestHook::default(),
        })
    }

    /// Set `job`'s reservation here to `reserved_bytes` (0: none; at most the capacity, more
    /// counts as the capacity), as the map of `epoch` names it, unless a map of a later epoch
    /// set it already; `account` is the job's account if the job has one already. Returns the
    /// account the reservation is held by, which the job's entries must charge from now on.
    pub fn set_reservation(
        &self,
        job: &str,
        epoch: u64,
        reserved_bytes: u64,
        account: Option<&Arc<JobAccount>>,
    ) -> Arc<JobAccount> {
        let mut reservations = self
            .reservations
            .lock()
            .expect("reservations lock poisoned");
        let known = reservations.epochs.len() < RESERVATION_EPOCHS_MAX
            || reservations.epochs.contains_key(job);
        match reservations.epochs.get_mut(job) {
            Some(latest) if epoch < *latest => {
                return Self::account_of(&reservations, job, account);
            }
            Some(latest) => *latest = epoch,
            None if known => {
                reservations.epochs.insert(job.to_string(), epoch);
            }
            None => {}
        }
        self.apply_reservation(
            &mut reservations,
            job,
            reserved_bytes.min(self.capacity_bytes),
            account,
        )
    }

    /// End `job`'s reservation here (its end): no share, and its epoch forgotten.
    pub fn end_reservation(&self, job: &str, account: Option<&Arc<JobAccount>>) {
        let mut reservations = self
            .reservations
            .lock()
            .expect("reservations lock poisoned");
        reservations.epochs.remove(job);
        self.apply_reservation(&mut reservations, job, 0, account);
    }

    /// The account `job`'s reservation is or would be held by.
    fn account_of(
        reservations: &Reservations,
        job: &str,
        account: Option<&Arc<JobAccount>>,
    ) -> Arc<JobAccount> {
        match (account, reservations.held.get(job)) {
            (Some(account), _) => Arc::clone(account),
            (None, Some(held)) => Arc::clone(held),
            (None, None) => Arc::new(JobAccount::default()),
        }
    }

    /// Set `job`'s reservation to `reserved_bytes` under the lock, between two bumps of
    /// `reservations_version`.
    fn apply_reservation(
        &self,
        reservations: &mut Reservations,
        job: &str,
        reserved_bytes: u64,
        account: Option<&Arc<JobAccount>>,
    ) -> Arc<JobAccount> {
        let held = Self::account_of(reservations, job, account);
        self.reservations_version.fetch_add(1, Ordering::SeqCst);
        held.reserved_bytes.store(reserved_bytes, Ordering::SeqCst);
        if reserved_bytes == 0 {
            reservations.held.remove(job);
        } else {
            reservations.held.insert(job.to_string(), Arc::clone(&held));
        }
        self.reserving_jobs
            .store(reservations.held.len(), Ordering::SeqCst);
        self.reservations_version.fetch_add(1, Ordering::SeqCst);
        held
    }

    /// The accounts of the jobs holding a reservation here, by job id (at most one per job
    /// whose reservation the service set, which its epoch table bounds).
    pub fn reserved_accounts(&self) -> Vec<(String, Arc<JobAccount>)> {
        self.reservations
            .lock()
            .expect("reservations lock poisoned")
            .held
            .iter()
            .map(|(job, account)| (job.clone(), Arc::clone(account)))
            .collect()
    }

    /// The account holding `job`'s reservation, if it holds one.
    pub fn reserved_account(&self, job: &str) -> Option<Arc<JobAccount>> {
        self.reservations
            .lock()
            .expect("reservations lock poisoned")
            .held
            .get(job)
            .cloned()
    }

    /// The unused reservations (reserved less used, at least 0) of every job but `job`, at
    /// most `u64::MAX`.
    fn reserved_for_others_bytes(&self, job: &Arc<JobAccount>) -> u64 {
        self.reservations
            .lock()
            .expect("reservations lock poisoned")
            .held
            .values()
            .filter(|held| !Arc::ptr_eq(held, job))
            .map(|held| {
                held.reserved_bytes
                    .load(Ordering::Acquire)
                    .saturating_sub(held.used_bytes.load(Ordering::Acquire))
            })
            .fold(0, u64::saturating_add)
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    pub fn used_bytes(&self) -> u64 {
        self.used_bytes.load(Ordering::Acquire)
    }

    /// The refusals counted since start (see [`Budget::count_refusal`]).
    pub fn refusals(&self) -> &Refusals {
        &self.refusals
    }

    /// Count `error`, if it refused a write of `job` for want of room (a charge here, or an
    /// engine allocation), server-wide and to the job.
    pub fn count_refusal(&self, job: &JobAccount, error: &StoreError) {
        self.refusals.count(error);
        job.refusals.count(error);
    }

    /// The most bytes charges of `kind` may hold together with everything else charged.
    fn limit_bytes(&self, kind: ChargeKind) -> u64 {
        match kind {
            ChargeKind::Data => self.capacity_bytes - self.reserve_bytes,
            ChargeKind::Record => self.capacity_bytes,
        }
    }

    /// Charge `bytes` of `kind` to `job`, or fail with `CapacityExhausted`, naming the limit it
    /// hit, and charge nothing.
    ///
    /// While no other job holds a reservation here, only the tier's limit bounds the charge (no
    /// lock; if the reservations changed between that check and the bytes being taken, the
    /// charge is undone and taken as below). Otherwise the charge also keeps the other jobs' unused reservations free (unless
    /// `job` stays within its own), decided under `admission`, so that two such charges cannot
    /// both take the same free bytes. The other jobs' usage is read inside the budget's
    /// compare-and-swap, and a charge is released from its job before the budget
    /// ([`Charge::drop`]), so a concurrent charge or release can only make the check stricter.
    ///
    /// A refusal is counted ([`Budget::count_refusal`]).
    pub fn charge(
        self: &Arc<Self>,
        job: &Arc<JobAccount>,
        bytes: u64,
        kind: ChargeKind,
    ) -> Result<Charge, StoreError> {
        let charged = self.charge_uncounted(job, bytes, kind);
        if let Err(error) = &charged {
            self.count_refusal(job, error);
        }
        charged
    }

    /// [`Budget::charge`] without counting a refusal.
    fn charge_uncounted(
        self: &Arc<Self>,
        job: &Arc<JobAccount>,
        bytes: u64,
        kind: ChargeKind,
    ) -> Result<Charge, StoreError> {
        // A seqlock read: the version is even and the same after the bytes are taken only if no
        // reservation changed in between, so the check held when they were taken.
        let version = self.reservations_version.load(Ordering::SeqCst);
        let reserving = self.reserving_jobs.load(Ordering::SeqCst);
        #[cfg(test)]
        self.hook.run(self);
        let alone = version % 2 == 0
            && (reserving == 0
                || (reserving == 1 && job.reserved_bytes.load(Ordering::SeqCst) > 0));
        if !alone {
            return self.charge_beside_reservations(job, bytes, kind);
        }
        let limit = self.limit_bytes(kind);
        let reserved = self
            .used_bytes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                used.checked_add(bytes).filter(|&total| total <= limit)
            });
        if let Err(used) = reserved {
            return Err(StoreError::CapacityExhausted {
                requested: bytes,
                available: limit.saturating_sub(used),
                limit: self.tier_limit(kind),
            });
        }
        if self.reservations_version.load(Ordering::SeqCst) != version {
            self.used_bytes.fetch_sub(bytes, Ordering::SeqCst);
            return self.charge_beside_reservations(job, bytes, kind);
        }
        Ok(self.charged(job, bytes))
    }

    /// [`Budget::charge`] while other jobs hold reservations here.
    fn charge_beside_reservations(
        self: &Arc<Self>,
        job: &Arc<JobAccount>,
        bytes: u64,
        kind: ChargeKind,
    ) -> Result<Charge, StoreError> {
        let _admission = self.admission.lock().expect("admission lock poisoned");
        let limit = self.limit_bytes(kind);
        let own_used = job.used_bytes.load(Ordering::Acquire);
        let own_reserved = job.reserved_bytes.load(Ordering::Acquire);
        let within = own_used
            .checked_add(bytes)
            .is_some_and(|total| total <= own_reserved);
        let mut others = 0;
        let reserved = self
            .used_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                let total = used.checked_add(bytes).filter(|&total| total <= limit)?;
                if within {
                    return Some(total);
                }
                others = self.reserved_for_others_bytes(job);
                (limit - total >= others).then_some(total)
            });
        match reserved {
            Ok(_) => Ok(self.charged(job, bytes)),
            Err(used) if used.saturating_add(bytes) > limit => Err(StoreError::CapacityExhausted {
                requested: bytes,
                available: limit.saturating_sub(used),
                limit: self.tier_limit(kind),
            }),
            Err(used) => Err(StoreError::CapacityExhausted {
                requested: bytes,
                available: limit.saturating_sub(used).saturating_sub(others),
                limit: CapacityLimit::Reserved {
                    capacity_bytes: self.capacity_bytes,
                    reserve_bytes: match kind {
                        ChargeKind::Data => self.reserve_bytes,
                        ChargeKind::Record => 0,
                    },
                    reserved_for_others_bytes: others,
                    job_used_bytes: own_used,
                    job_reserved_bytes: own_reserved,
                },
            }),
        }
    }

    /// The tier's own limit for charges of `kind`, as a refusal names it.
    fn tier_limit(&self, kind: ChargeKind) -> CapacityLimit {
        match kind {
            ChargeKind::Data => CapacityLimit::Data {
                capacity_bytes: self.capacity_bytes,
                reserve_bytes: self.reserve_bytes,
            },
            ChargeKind::Record => CapacityLimit::Records {
                capacity_bytes: self.capacity_bytes,
            },
        }
    }

    /// The guard of `bytes` already added to the budget, counted to `job`.
    fn charged(self: &Arc<Self>, job: &Arc<JobAccount>, bytes: u64) -> Charge {
        job.used_bytes.fetch_add(bytes, Ordering::AcqRel);
        Charge {
            bytes,
            budget: Arc::clone(self),
            job: Arc::clone(job),
        }
    }
}

impl Charge {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Charge {
    /// Released from the job before the budget: in between, the job's unused reservation looks
    /// larger while the budget's free bytes do not yet, so other jobs' charges are checked
    /// stricter, never looser.
    fn drop(&mut self) {
        self.job.used_bytes.fetch_sub(self.bytes, Ordering::AcqRel);
        let before = self
            .budget
            .used_bytes
            .fetch_sub(self.bytes, Ordering::AcqRel);
        assert!(
            before >= self.bytes,
            "budget released more than was charged"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The refusal of a charge of `bytes` of `kind` to `job`, which must be refused with
    /// `CapacityExhausted` naming `bytes` as requested: the bytes it names available, and its
    /// limit.
    fn refused(
        budget: &Arc<Budget>,
        job: &Arc<JobAccount>,
        bytes: u64,
        kind: ChargeKind,
    ) -> (u64, CapacityLimit) {
        match budget.charge(job, bytes, kind) {
            Err(StoreError::CapacityExhausted {
                requested,
                available,
                limit,
            }) => {
                assert_eq!(requested, bytes);
                (available, limit)
            }
            other => panic!("expected CapacityExhausted, got {other:?}"),
        }
    }

    #[test]
    fn charges_are_bounded_and_released_on_drop() {
        // Capacity 6,400: 100 bytes of it are the records' reserve.
        let budget = Budget::new(6_400);
        let job = Arc::new(JobAccount::default());
        let a = budget.charge(&job, 6_000, ChargeKind::Data).unwrap();
        assert_eq!(
            refused(&budget, &job, 301, ChargeKind::Data),
            (
                300,
                CapacityLimit::Data {
                    capacity_bytes: 6_400,
                    reserve_bytes: 100
                }
            )
        );
        let b = budget.charge(&job, 300, ChargeKind::Data).unwrap();
        // Data stops at the reserve; records go on into it, up to the capacity.
        assert!(budget.charge(&job, 1, ChargeKind::Data).is_err());
        let c = budget.charge(&job, 100, ChargeKind::Record).unwrap();
        assert_eq!(
            refused(&budget, &job, 1, ChargeKind::Record),
            (
                0,
                CapacityLimit::Records {
                    capacity_bytes: 6_400
                }
            )
        );
        assert_eq!(
            (budget.used_bytes(), job.used_bytes.load(Ordering::Relaxed)),
            (6_400, 6_400)
        );
        drop(a);
        drop(b);
        drop(c);
        assert_eq!(
            (budget.used_bytes(), job.used_bytes.load(Ordering::Relaxed)),
            (0, 0)
        );
    }

    #[test]
    fn a_job_beyond_its_reservation_leaves_the_others_unused_reservations_free() {
        // Data may use 6,300 bytes; job B reserves 2,000 of them, job A 1,000.
        let budget = Budget::new(6_400);
        let a = budget.set_reservation("a", 1, 1_000, None);
        let b = budget.set_reservation("b", 1, 2_000, None);
        let a_within = budget.charge(&a, 1_000, ChargeKind::Data).unwrap();
        let a_beyond = budget.charge(&a, 3_300, ChargeKind::Data).unwrap();
        // 2,000 bytes are free, all of them B's.
        assert_eq!(
            refused(&budget, &a, 1, ChargeKind::Data),
            (
                0,
                CapacityLimit::Reserved {
                    capacity_bytes: 6_400,
                    reserve_bytes: 100,
                    reserved_for_others_bytes: 2_000,
                    job_used_bytes: 4_300,
                    job_reserved_bytes: 1_000,
                }
            )
        );
        let message = budget
            .charge(&a, 1, ChargeKind::Data)
            .unwrap_err()
            .to_string();
        assert!(message.contains("reserved for other jobs"), "{message}");
        // B writes its whole reservation.
        let b_part = budget.charge(&b, 1_500, ChargeKind::Data).unwrap();
        let b_rest = budget.charge(&b, 500, ChargeKind::Data).unwrap();
        assert_eq!(budget.used_bytes(), 6_300);
        // Beyond it, B meets the tier's limit like anyone.
        assert!(matches!(
            refused(&budget, &b, 1, ChargeKind::Data),
            (_, CapacityLimit::Data { .. })
        ));
        // B frees some: it stays B's until B's reservation ends.
        drop(b_rest);
        assert_eq!(refused(&budget, &a, 500, ChargeKind::Data).0, 0);
        budget.set_reservation("b", 1, 0, Some(&b));
        let a_more = budget.charge(&a, 500, ChargeKind::Data).unwrap();
        assert_eq!(
            (
                budget.used_bytes(),
                a.used_bytes.load(Ordering::Relaxed),
                b.used_bytes.load(Ordering::Relaxed)
            ),
            (6_300, 4_800, 1_500)
        );
        // Each refusal was counted under its limit, to the refused job and server-wide.
        let (reserved, data) = (
            crate::RefusalCounts {
                reserved: 3,
                ..Default::default()
            },
            crate::RefusalCounts {
                data: 1,
                ..Default::default()
            },
        );
        assert_eq!((a.refusals.counts(), b.refusals.counts()), (reserved, data));
        assert_eq!(
            budget.refusals().counts(),
            crate::RefusalCounts {
                data: 1,
                reserved: 3,
                ..Default::default()
            }
        );
        drop((a_within, a_beyond, b_part, a_more));
        assert_eq!(budget.used_bytes(), 0);
    }

    #[test]
    fn a_job_alone_is_bounded_by_the_tier_only() {
        let budget = Budget::new(6_400);
        let a = budget.set_reservation("a", 1, 1_000, None);
        let other = Arc::new(JobAccount::default());
        let whole = budget.charge(&a, 6_300, ChargeKind::Data).unwrap();
        assert!(matches!(
            refused(&budget, &a, 1, ChargeKind::Data),
            (_, CapacityLimit::Data { .. })
        ));
        drop(whole);
        // A job without a reservation beside the only reserving one keeps its unused bytes
        // free; the reserving one is bounded by the tier only.
        let others = budget.charge(&other, 5_300, ChargeKind::Data).unwrap();
        assert!(matches!(
            refused(&budget, &other, 1, ChargeKind::Data),
            (
                _,
                CapacityLimit::Reserved {
                    reserved_for_others_bytes: 1_000,
                    job_reserved_bytes: 0,
                    ..
                }
            )
        ));
        let own = budget.charge(&a, 1_000, ChargeKind::Data).unwrap();
        drop((others, own));
        assert_eq!(budget.used_bytes(), 0);
    }

    #[test]
    fn records_may_use_the_reserve_but_not_the_others_reservations() {
        let budget = Budget::new(6_400);
        let b = budget.set_reservation("b", 1, 2_000, None);
        let a = Arc::new(JobAccount::default());
        let data = budget.charge(&a, 4_300, ChargeKind::Data).unwrap();
        assert!(budget.charge(&a, 1, ChargeKind::Data).is_err());
        // Records go on into the records' reserve ...
        let records = budget.charge(&a, 100, ChargeKind::Record).unwrap();
        // ... and no further.
        let (available, limit) = refused(&budget, &a, 1, ChargeKind::Record);
        assert_eq!(available, 0);
        assert!(matches!(
            limit,
            CapacityLimit::Reserved {
                reserve_bytes: 0,
                reserved_for_others_bytes: 2_000,
                ..
            }
        ));
        // B's records within its reservation are admitted; so is its data up to the tier's
        // limit for data, which A's records took 100 bytes of (the reserve's worth).
        let b_data = budget.charge(&b, 1_900, ChargeKind::Data).unwrap();
        assert!(budget.charge(&b, 1, ChargeKind::Data).is_err());
        let b_record = budget.charge(&b, 100, ChargeKind::Record).unwrap();
        drop((data, records, b_data, b_record));
        assert_eq!(budget.used_bytes(), 0);
    }

    #[test]
    fn racing_charges_never_take_another_jobs_unused_reservation() {
        use std::sync::Barrier;
        for _ in 0..50 {
            let budget = Budget::new(64_000);
            let b = budget.set_reservation("b", 1, 20_000, None);
            let a = budget.set_reservation("a", 1, 1_000, None);
            let barrier = Arc::new(Barrier::new(4));
            // Two writers of A charge 100-byte pieces until refused; two of B charge 100 pieces
            // each, B's whole reservation, all of which must be admitted.
            let writers: Vec<_> = [(&a, None), (&a, None), (&b, Some(100)), (&b, Some(100))]
                .into_iter()
                .map(|(job, pieces)| {
                    let job = Arc::clone(job);
                    let budget = Arc::clone(&budget);
                    let barrier = Arc::clone(&barrier);
                    std::thread::spawn(move || {
                        barrier.wait();
                        let mut held = Vec::new();
                        while pieces.is_none_or(|n| held.len() < n) {
                            match budget.charge(&job, 100, ChargeKind::Data) {
                                Ok(charge) => held.push(charge),
                                Err(err) if pieces.is_none() => {
                                    assert!(matches!(err, StoreError::CapacityExhausted { .. }));
                                    break;
                                }
                                Err(err) => panic!("B refused within its reservation: {err}"),
                            }
                        }
                        held
                    })
                })
                .collect();
            let held: Vec<Vec<Charge>> = writers.into_iter().map(|w| w.join().unwrap()).collect();
            // B got its whole reservation, A the rest of the room for data, nobody more.
            assert_eq!(b.used_bytes.load(Ordering::Relaxed), 20_000);
            assert_eq!(a.used_bytes.load(Ordering::Relaxed), 63_000 - 20_000);
            assert_eq!(budget.used_bytes(), 63_000);
            drop(held);
            assert_eq!(budget.used_bytes(), 0);
        }
    }

    #[test]
    fn a_reservation_set_during_a_lock_free_charge_bounds_it() {
        // Data may use 6,300 bytes. A alone holds a reservation (1,000) and 5,000 bytes; B's
        // reservation of 2,000 arrives while A's charge of 1,000 is past its lock-free check.
        let budget = Budget::new(6_400);
        let a = budget.set_reservation("a", 1, 1_000, None);
        let _held = budget.charge(&a, 5_000, ChargeKind::Data).unwrap();
        budget.hook.set(|budget| {
            budget.set_reservation("b", 1, 2_000, None);
        });
        let (available, limit) = refused(&budget, &a, 1_000, ChargeKind::Data);
        assert!(matches!(
            limit,
            CapacityLimit::Reserved {
                reserved_for_others_bytes: 2_000,
                ..
            }
        ));
        assert_eq!((available, budget.used_bytes()), (0, 5_000));

        // B alone holds a reservation (2,000); A holds 4,000 bytes and gets its own reservation
        // while its charge is between reading that one job holds one and reading its own.
        let budget = Budget::new(6_400);
        budget.set_reservation("b", 1, 2_000, None);
        let a = Arc::new(JobAccount::default());
        let _held = budget.charge(&a, 4_000, ChargeKind::Data).unwrap();
        let account = Arc::clone(&a);
        budget.hook.set(move |budget| {
            budget.set_reservation("a", 1, 1_000, Some(&account));
        });
        let (available, limit) = refused(&budget, &a, 1_000, ChargeKind::Data);
        assert!(matches!(
            limit,
            CapacityLimit::Reserved {
                reserved_for_others_bytes: 2_000,
                job_reserved_bytes: 1_000,
                ..
            }
        ));
        assert_eq!((available, budget.used_bytes()), (300, 4_000));
        // Within the room B leaves free, the same charge is admitted.
        budget.charge(&a, 300, ChargeKind::Data).unwrap();
    }

    #[test]
    fn charges_racing_a_reservation_being_set_leave_it_free() {
        use std::sync::atomic::AtomicBool;
        // A alone holds a reservation; two writers of A charge 100-byte pieces while B's
        // reservation of 20,000 is set. Once set, A may only fill the room B leaves free: the
        // writers end at 63,000 - 20,000 unless they had passed that before B's arrived.
        for _ in 0..200 {
            let budget = Budget::new(64_000);
            let a = budget.set_reservation("a", 1, 1_000, None);
            let stop = Arc::new(AtomicBool::new(false));
            let writers: Vec<_> = (0..2)
                .map(|_| {
                    let (a, budget, stop) =
                        (Arc::clone(&a), Arc::clone(&budget), Arc::clone(&stop));
                    std::thread::spawn(move || {
                        let mut held = Vec::new();
                        while !stop.load(Ordering::SeqCst) {
                            if let Ok(charge) = budget.charge(&a, 100, ChargeKind::Data) {
                                held.push(charge);
                            }
                        }
                        held
                    })
                })
                .collect();
            while budget.used_bytes() < 40_000 {
                std::hint::spin_loop();
            }
            budget.set_reservation("b", 1, 20_000, None);
            let used_when_set = budget.used_bytes();
            stop.store(true, Ordering::SeqCst);
            let held: Vec<Vec<Charge>> = writers.into_iter().map(|w| w.join().unwrap()).collect();
            assert!(
                budget.used_bytes() <= used_when_set.max(63_000 - 20_000),
                "A took {} bytes, {} when B's reservation was set",
                budget.used_bytes(),
                used_when_set
            );
            drop(held);
        }
    }

    #[test]
    fn an_older_epochs_reservation_never_replaces_a_newer_ones() {
        let budget = Budget::new(6_400);
        let a = budget.set_reservation("a", 5, 1_000, None);
        // A retry of epoch 4's map arrives after epoch 5's.
        budget.set_reservation("a", 4, 3_000, Some(&a));
        assert_eq!(a.reserved_bytes.load(Ordering::Relaxed), 1_000);
        // Epoch 6 moves the reservation away; epoch 5's retry does not bring it back.
        budget.set_reservation("a", 6, 0, Some(&a));
        budget.set_reservation("a", 5, 1_000, Some(&a));
        assert_eq!(a.reserved_bytes.load(Ordering::Relaxed), 0);
        assert!(budget.reserved_account("a").is_none());
        // The same epoch again (a retry) applies; after the job's end any epoch does.
        budget.set_reservation("a", 6, 500, Some(&a));
        assert_eq!(a.reserved_bytes.load(Ordering::Relaxed), 500);
        budget.end_reservation("a", Some(&a));
        assert_eq!(a.reserved_bytes.load(Ordering::Relaxed), 0);
        budget.set_reservation("a", 1, 700, Some(&a));
        assert_eq!(a.reserved_bytes.load(Ordering::Relaxed), 700);
    }

    #[test]
    fn huge_reservations_count_as_the_capacity() {
        // Two jobs' reservations of u64::MAX bytes: each counts as the capacity (6,400), and
        // their sum does not overflow.
        let budget = Budget::new(6_400);
        let b = budget.set_reservation("b", 1, u64::MAX, None);
        budget.set_reservation("c", 1, u64::MAX, None);
        assert_eq!(b.reserved_bytes.load(Ordering::Relaxed), 6_400);
        let d = Arc::new(JobAccount::default());
        let (available, limit) = refused(&budget, &d, 1, ChargeKind::Data);
        assert!(matches!(
            limit,
            CapacityLimit::Reserved {
                reserved_for_others_bytes: 12_800,
                ..
            }
        ));
        assert_eq!(available, 0);
        // B itself stays within its reservation up to the tier's limit.
        budget.charge(&b, 6_300, ChargeKind::Data).unwrap();
    }

    #[test]
    fn the_reserve_is_a_64th_of_the_capacity_at_most_64_mib() {
        assert_eq!(Budget::new(1 << 30).reserve_bytes, 16 << 20);
        assert_eq!(Budget::new(1 << 40).reserve_bytes, RECORD_RESERVE_MAX_BYTES);
        assert_eq!(Budget::new(100).reserve_bytes, 1);
    }
}
