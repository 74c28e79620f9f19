//! Prefix leases: a job's prefixes (`stage/task`) that live while the job renews them.
//!
//! A lease covers every key that starts with `<prefix>/`, in every bucket of the job, with its
//! queues and append files. The job's driver renews many prefixes in one call (it expands each
//! renewal to the prefix's ancestors and descendants, so the server keeps a flat table); a lease
//! that is not renewed in time lapses, and the sweeper frees its prefix on this server at once.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pocketflow_protocol::limits::{LEASE_MS_MAX, LEASE_MS_MIN, LEASE_PREFIXES_MAX};

use crate::error::StoreError;

/// Most leases one server holds (over all jobs).
pub const LEASES_MAX: usize = 65_536;

/// The lease table of one server: (job, prefix) to expiry.
#[derive(Default)]
pub struct Leases {
    table: Mutex<BTreeMap<(String, String), Instant>>,
}

impl Leases {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<(String, String), Instant>> {
        self.table.lock().expect("lease table lock poisoned")
    }

    /// Renew (or start) the leases of `prefixes` of `job` for `lease_ms` from now; returns how
    /// many leases the job holds here afterwards.
    pub fn renew(
        &self,
        job: &str,
        prefixes: &[String],
        lease_ms: u64,
    ) -> Result<usize, StoreError> {
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
        let mut table = self.lock();
        let new = prefixes
            .iter()
            .filter(|p| !table.contains_key(&(job.to_string(), (*p).clone())))
            .count();
        if table.len() + new > LEASES_MAX {
            return Err(StoreError::CapacityExhausted {
                requested: new as u64,
                available: (LEASES_MAX - table.len()) as u64,
            });
        }
        for prefix in prefixes {
            let entry = table
                .entry((job.to_string(), prefix.clone()))
                .or_insert(expiry);
            *entry = (*entry).max(expiry);
        }
        Ok(table.keys().filter(|(j, _)| j == job).count())
    }

    /// Remove and return the leases that lapsed by `now`, as (job, prefix).
    pub fn take_lapsed(&self, now: Instant) -> Vec<(String, String)> {
        let mut table = self.lock();
        let lapsed: Vec<(String, String)> = table
            .iter()
            .filter(|(_, expiry)| **expiry <= now)
            .map(|(key, _)| key.clone())
            .collect();
        for key in &lapsed {
            table.remove(key);
        }
        lapsed
    }

    /// End the leases of `prefixes` of `job` now: remove and return those the job holds (the
    /// caller frees them); prefixes without a lease here are skipped.
    pub fn end(&self, job: &str, prefixes: &[String]) -> Vec<String> {
        let mut table = self.lock();
        prefixes
            .iter()
            .filter(|p| table.remove(&(job.to_string(), (*p).clone())).is_some())
            .cloned()
            .collect()
    }

    /// Forget every lease of `job` (its data is gone with it).
    pub fn forget_job(&self, job: &str) {
        self.lock().retain(|(j, _), _| j != job);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_lapse_unless_renewed_and_are_bounded() {
        let leases = Leases::default();
        let p = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(leases.renew("j", &p(&["map", "map/1"]), 100).unwrap(), 2);
        assert!(leases.renew("j", &p(&["x"]), 10).is_err());
        assert!(leases.renew("j", &[], 100).is_err());
        let later = Instant::now() + Duration::from_millis(150);
        leases.renew("j", &p(&["map"]), 1000).unwrap();
        assert_eq!(
            leases.take_lapsed(later),
            vec![("j".into(), "map/1".into())]
        );
        assert!(leases.take_lapsed(later).is_empty());
        assert_eq!(leases.end("j", &p(&["map", "nope"])), p(&["map"]));
        assert!(leases.end("j", &p(&["map"])).is_empty());
        leases.forget_job("j");
        assert!(leases
            .take_lapsed(later + Duration::from_secs(5))
            .is_empty());
    }
}
