//! Prefix leases: a job's prefixes (`stage/task`) that live while the job renews them.
//!
//! A lease covers every key that starts with `<prefix>/`, in every bucket of the job, with its
//! queues and append files. The job's driver renews many prefixes in one call (it expands each
//! renewal to the prefix's ancestors and descendants, so the server keeps a flat table); a lease
//! that is not renewed in time lapses, and the sweeper frees its prefix on this server at once.
//! A lease that lapsed or that the job ended stays in the table, ended, for one more lease, and
//! its prefix is freed again when that lapses: what a straggler wrote under it meanwhile is not
//! left for the job's whole life.
//!
//! The table is shared by every job, and each job's share is bounded ([`LEASES_PER_JOB_MAX`]):
//! one job filling its share is refused alone. A renewal renews every lease the job holds and
//! starts the new ones that fit; only the new prefixes past the job's share (or past the table's
//! bound) are refused, with [`StoreError::LeaseTableFull`], so a refusal never lapses a lease.
//! To make room a job's own lingering ended leases go first: their prefixes are freed (a second
//! time) at once instead of a lease later.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pocketflow_protocol::limits::{LEASE_MS_MAX, LEASE_MS_MIN, LEASE_PREFIXES_MAX};

use crate::error::StoreError;

/// Most leases one server holds (over all jobs).
pub const LEASES_MAX: usize = 65_536;

/// Most leases one job holds on one server, lingering ended ones included: an eighth of the
/// table, so a job that fills its share leaves the rest to seven others at least.
pub const LEASES_PER_JOB_MAX: usize = LEASES_MAX / 8;

/// One lease: when it lapses, how long its last renewal was for, and whether the job ended it.
#[derive(Clone, Copy, Debug)]
struct Lease {
    expiry: Instant,
    lease_ms: u64,
    /// Ended by the job: its prefix was freed then, and the entry lingers one more lease so
    /// that what a straggler writes under it meanwhile is freed when it lapses.
    ended: bool,
}

/// The lease table of one server: (job, prefix) to its lease, and each job's count.
#[derive(Default)]
pub struct Leases {
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    leases: BTreeMap<(String, String), Lease>,
    /// Entries of each job in `leases` (lingering ended ones included).
    per_job: HashMap<String, usize>,
}

impl Table {
    fn held(&self, job: &str) -> usize {
        self.per_job.get(job).copied().unwrap_or(0)
    }

    fn insert(&mut self, job: &str, prefix: &str, lease: Lease) {
        self.leases
            .insert((job.to_string(), prefix.to_string()), lease);
        *self.per_job.entry(job.to_string()).or_default() += 1;
    }

    fn remove(&mut self, job: &str, prefix: &str) {
        if self
            .leases
            .remove(&(job.to_string(), prefix.to_string()))
            .is_some()
        {
            let held = self.per_job.get_mut(job).expect("counted with its lease");
            *held -= 1;
            if *held == 0 {
                self.per_job.remove(job);
            }
        }
    }

    /// The entries of `job`, in prefix order.
    fn of_job<'a>(&'a self, job: &'a str) -> impl Iterator<Item = (&'a String, &'a Lease)> + 'a {
        self.leases
            .range((job.to_string(), String::new())..)
            .take_while(move |((j, _), _)| j == job)
            .map(|((_, prefix), lease)| (prefix, lease))
    }

    fn live(&self, job: &str) -> usize {
        self.of_job(job).filter(|(_, lease)| !lease.ended).count()
    }
}

/// What a renewal did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Renewal {
    /// Live leases the job holds afterwards.
    pub leases: usize,
    /// Ended leases of the job taken off the table to make room: their prefixes are to be
    /// freed now (their second free, a lease early).
    pub retired: Vec<String>,
    /// New prefixes refused: past the job's share, or past the table's bound.
    pub refused: Vec<String>,
    /// Which bound refused them.
    pub refused_why: Option<String>,
}

/// A lease taken off the table by [`Leases::take_lapsed`].
#[derive(Debug, PartialEq, Eq)]
pub struct Lapsed {
    /// The job that held it.
    pub job: String,
    /// Its prefix.
    pub prefix: String,
    /// The job had ended it: its prefix was freed then, and this frees only what was written
    /// under it since.
    pub ended: bool,
}

impl Leases {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().expect("lease table lock poisoned")
    }

    /// Renew (or start) the leases of `prefixes` of `job` for `lease_ms` from now. Every lease
    /// the job holds among them is renewed (an ended one revived); a new one is started while
    /// the job holds fewer than [`LEASES_PER_JOB_MAX`] entries and the table fewer than
    /// [`LEASES_MAX`], making room first by retiring the job's own ended leases; the rest are
    /// refused. Fails only on bad arguments, before touching the table.
    pub fn renew(
        &self,
        job: &str,
        prefixes: &[String],
        lease_ms: u64,
    ) -> Result<Renewal, StoreError> {
        if !(LEASE_MS_MIN..=LEASE_MS_MAX).contains(&lease_ms) {
            return Err(StoreError::InvalidChannelArgument {
                what: "lease_ms",
                value: lease_ms,
                min: LEASE_MS_MIN,
                max: LEASE_MS_MAX,
            });
        }
        if prefixes.is_empty() || prefixes.len() > LEASE_PREFIXES_MAX {
            return Err(StoreError::InvalidChannelArgument {
                what: "prefix count",
                value: prefixes.len() as u64,
                min: 1,
                max: LEASE_PREFIXES_MAX as u64,
            });
        }
        let expiry = Instant::now() + Duration::from_millis(lease_ms);
        let fresh = Lease {
            expiry,
            lease_ms,
            ended: false,
        };
        let mut table = self.lock();
        let mut renewal = Renewal::default();
        // Ended leases of the job that may go to make room, the soonest to lapse first; those
        // this renewal revives are skipped when their turn comes.
        let mut spare: Vec<(Instant, String)> = Vec::new();
        let mut spare_listed = false;
        for prefix in prefixes {
            let key = (job.to_string(), prefix.clone());
            if let Some(entry) = table.leases.get_mut(&key) {
                // A renewal also revives a lease the job ended (declared again, or a renewal
                // that was on its way when the job ended it).
                if entry.ended {
                    *entry = fresh;
                } else {
                    entry.expiry = entry.expiry.max(expiry);
                    entry.lease_ms = lease_ms;
                }
                continue;
            }
            let full = |t: &Table| {
                if t.held(job) >= LEASES_PER_JOB_MAX {
                    Some(format!(
                        "job '{job}' holds the most leases one job may hold on this server \
                         ({LEASES_PER_JOB_MAX})"
                    ))
                } else if t.leases.len() >= LEASES_MAX {
                    Some(format!(
                        "this server's lease table holds its maximum of {LEASES_MAX} leases"
                    ))
                } else {
                    None
                }
            };
            while full(&table).is_some() {
                if !spare_listed {
                    spare = table
                        .of_job(job)
                        .filter(|(_, lease)| lease.ended)
                        .map(|(p, lease)| (lease.expiry, p.clone()))
                        .collect();
                    spare.sort_unstable_by(|a, b| b.cmp(a));
                    spare_listed = true;
                }
                let Some((_, retired)) = spare.pop() else {
                    break;
                };
                let still_ended = table
                    .leases
                    .get(&(job.to_string(), retired.clone()))
                    .is_some_and(|lease| lease.ended);
                if still_ended {
                    table.remove(job, &retired);
                    renewal.retired.push(retired);
                }
            }
            match full(&table) {
                None => table.insert(job, prefix, fresh),
                Some(why) => {
                    renewal.refused_why.get_or_insert(why);
                    renewal.refused.push(prefix.clone());
                }
            }
        }
        renewal.leases = table.live(job);
        Ok(renewal)
    }

    /// Return the leases that lapsed by `now` (the caller frees their prefixes). A live one
    /// stays in the table, ended, for one more lease from `now`, as [`Leases::end`] leaves
    /// one; an ended one leaves the table.
    pub fn take_lapsed(&self, now: Instant) -> Vec<Lapsed> {
        let mut guard = self.lock();
        let table = &mut *guard;
        let mut lapsed = Vec::new();
        let per_job = &mut table.per_job;
        table.leases.retain(|(job, prefix), lease| {
            if lease.expiry > now {
                return true;
            }
            lapsed.push(Lapsed {
                job: job.clone(),
                prefix: prefix.clone(),
                ended: lease.ended,
            });
            if lease.ended {
                let held = per_job.get_mut(job).expect("counted with its lease");
                *held -= 1;
                if *held == 0 {
                    per_job.remove(job);
                }
                return false;
            }
            lease.ended = true;
            lease.expiry = now + Duration::from_millis(lease.lease_ms);
            true
        });
        lapsed
    }

    /// End the leases of `prefixes` of `job` now and return those the job held (the caller
    /// frees them); prefixes without a live lease here are skipped. Each ended lease stays in
    /// the table, ended, for one more lease from now: what a straggler writes under it in that
    /// time is freed when it lapses, instead of living as long as the job.
    pub fn end(&self, job: &str, prefixes: &[String]) -> Vec<String> {
        let now = Instant::now();
        let mut table = self.lock();
        prefixes
            .iter()
            .filter(
                |p| match table.leases.get_mut(&(job.to_string(), (*p).clone())) {
                    Some(lease) if !lease.ended => {
                        lease.ended = true;
                        lease.expiry = now + Duration::from_millis(lease.lease_ms);
                        true
                    }
                    _ => false,
                },
            )
            .cloned()
            .collect()
    }

    /// Forget every lease of `job` (its data is gone with it).
    pub fn forget_job(&self, job: &str) {
        let mut table = self.lock();
        table.leases.retain(|(j, _), _| j != job);
        table.per_job.remove(job);
    }

    /// Entries (live and lingering ended) of `job` in the table.
    pub fn held(&self, job: &str) -> usize {
        self.lock().held(job)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_lapse_unless_renewed_and_are_bounded() {
        let leases = Leases::default();
        let p = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let live = |r: Result<Renewal, StoreError>| r.unwrap().leases;
        assert_eq!(live(leases.renew("j", &p(&["map", "map/1"]), 100)), 2);
        assert!(leases.renew("j", &p(&["x"]), 10).is_err());
        assert!(leases.renew("j", &[], 100).is_err());
        let later = Instant::now() + Duration::from_millis(150);
        leases.renew("j", &p(&["map"]), 1000).unwrap();
        let lapsed = |job: &str, prefix: &str, ended: bool| Lapsed {
            job: job.into(),
            prefix: prefix.into(),
            ended,
        };
        assert_eq!(leases.take_lapsed(later), vec![lapsed("j", "map/1", false)]);
        assert!(leases.take_lapsed(later).is_empty());
        // A lapsed lease lingers, ended, one more lease (100 ms), then leaves.
        assert_eq!(
            leases.take_lapsed(later + Duration::from_millis(100)),
            vec![lapsed("j", "map/1", true)]
        );
        // Ended: no longer counted, ended once, and it lapses one lease (1 s) after the end.
        assert_eq!(leases.end("j", &p(&["map", "nope"])), p(&["map"]));
        assert!(leases.end("j", &p(&["map"])).is_empty());
        assert_eq!(live(leases.renew("j", &p(&["other"]), 100)), 1);
        assert_eq!(
            leases.take_lapsed(Instant::now() + Duration::from_millis(500)),
            vec![lapsed("j", "other", false)]
        );
        let much_later = Instant::now() + Duration::from_millis(1100);
        assert_eq!(
            leases.take_lapsed(much_later),
            vec![lapsed("j", "map", true), lapsed("j", "other", true)]
        );
        // A renewal revives an ended lease.
        leases.renew("j", &p(&["map"]), 100).unwrap();
        assert_eq!(leases.end("j", &p(&["map"])), p(&["map"]));
        assert_eq!(live(leases.renew("j", &p(&["map"]), 100)), 1);
        leases.forget_job("j");
        assert_eq!(leases.held("j"), 0);
        assert!(leases
            .take_lapsed(later + Duration::from_secs(5))
            .is_empty());
    }

    fn names(prefix: &str, count: usize) -> Vec<String> {
        (0..count).map(|i| format!("{prefix}/{i}")).collect()
    }

    #[test]
    fn a_job_past_its_share_is_refused_alone_and_keeps_its_leases() {
        let leases = Leases::default();
        assert_eq!(leases.renew("b", &names("keep", 2), 100).unwrap().leases, 2);
        // Job a fills its share in renewals of the most prefixes one call names.
        let mut held = 0;
        for round in 0.. {
            let renewal = leases
                .renew("a", &names(&format!("a{round}"), LEASE_PREFIXES_MAX), 100)
                .unwrap();
            held = renewal.leases;
            if !renewal.refused.is_empty() {
                assert!(
                    renewal.refused_why.unwrap().contains("most leases one job"),
                    "the job's share refused it"
                );
                break;
            }
        }
        assert_eq!(held, LEASES_PER_JOB_MAX);
        assert_eq!(leases.held("a"), LEASES_PER_JOB_MAX);
        // Its old prefixes still renew, with a new one refused in the same call.
        let mut mixed = names("a0", 3);
        mixed.push("a-new".into());
        let renewal = leases.renew("a", &mixed, 5_000).unwrap();
        assert_eq!(renewal.refused, vec!["a-new".to_string()]);
        let lapsed = leases.take_lapsed(Instant::now() + Duration::from_millis(1_000));
        let lapsed_of_a = |prefix: &str| lapsed.iter().any(|l| l.job == "a" && l.prefix == prefix);
        assert!(lapsed_of_a("a0/3"), "a lease not renewed lapsed");
        assert!(
            !mixed[..3].iter().any(|p| lapsed_of_a(p)),
            "the renewed leases did not lapse"
        );
        // Job b renews and grows as if a were not there.
        let renewal = leases.renew("b", &names("keep", 3), 100).unwrap();
        assert!(renewal.refused.is_empty());
        assert_eq!(renewal.leases, 3);
    }

    #[test]
    fn ended_leases_of_the_job_make_room_and_the_table_is_bounded() {
        let leases = Leases::default();
        let first = names("x", LEASES_PER_JOB_MAX);
        for chunk in first.chunks(LEASE_PREFIXES_MAX) {
            assert!(leases.renew("a", chunk, 100).unwrap().refused.is_empty());
        }
        assert_eq!(leases.end("a", &first[..2]).len(), 2);
        // Two ended leases linger; two new prefixes take their places, a third is refused.
        let renewal = leases.renew("a", &names("y", 3), 100).unwrap();
        assert_eq!(renewal.retired.len(), 2);
        assert_eq!(renewal.refused, vec!["y/2".to_string()]);
        assert_eq!(leases.held("a"), LEASES_PER_JOB_MAX);
        // Eight jobs at their share fill the table; a ninth is refused by the table's bound.
        for job in 1..8 {
            for chunk in names("z", LEASES_PER_JOB_MAX).chunks(LEASE_PREFIXES_MAX) {
                let renewal = leases.renew(&format!("j{job}"), chunk, 100).unwrap();
                assert!(renewal.refused.is_empty());
            }
        }
        let renewal = leases.renew("late", &names("w", 1), 100).unwrap();
        assert_eq!(renewal.refused.len(), 1);
        assert!(renewal
            .refused_why
            .unwrap()
            .contains("lease table holds its maximum"));
    }
}
