//! Prefix leases seen from the index: renewing them, and freeing the prefixes whose leases
//! lapsed or were ended.

use std::time::Instant;

use pocketflow_protocol::limits::KEY_MAX_BYTES;

use super::{check_name, Store};
use crate::error::StoreError;
use crate::events::EventOp;

impl Store {
    /// Renew (or start) leases of `prefixes` of `job` for `lease_ms`; see [`Leases::renew`].
    /// Returns the job's live leases here. New prefixes past the job's share of the table (or
    /// the table's bound) fail the call with `LeaseTableFull` after every lease the job held
    /// was renewed and the others were started; ended leases retired to make room are freed now.
    pub fn renew_leases(
        &self,
        job: &str,
        prefixes: &[String],
        lease_ms: u64,
    ) -> Result<usize, StoreError> {
        for prefix in prefixes {
            check_name("prefix", prefix, KEY_MAX_BYTES - 1)?;
        }
        let renewal = self.shared.leases.renew(job, prefixes, lease_ms)?;
        for retired in &renewal.retired {
            self.free_prefix(job, retired, false);
        }
        match renewal.refused.first() {
            None => Ok(renewal.leases),
            Some(first) => Err(StoreError::LeaseTableFull {
                job: job.to_string(),
                refused: renewal.refused.len(),
                first: first.clone(),
                held: renewal.leases,
                why: renewal.refused_why.unwrap_or_default(),
            }),
        }
    }

    /// Free every prefix whose lease lapsed by `now`: in every bucket of its job, the records,
    /// data blocks, queues and append files under `<prefix>/`; each one's subscribers get a
    /// `lease_expired` event. A lease that had lapsed or been ended was freed then: its second
    /// lapse, one lease later, frees what a straggler wrote under it since, with an event only
    /// if that deleted records. Returns (job, prefix, bytes freed) per lapsed lease.
    pub fn expire_leases(&self, now: Instant) -> Vec<(String, String, u64)> {
        self.shared
            .leases
            .take_lapsed(now)
            .into_iter()
            .map(|lapsed| {
                let bytes = self.free_prefix(&lapsed.job, &lapsed.prefix, !lapsed.ended);
                (lapsed.job, lapsed.prefix, bytes)
            })
            .collect()
    }

    /// End the leases of `prefixes` of `job` now (the job consumed their data) and free each
    /// one as a lapse would; prefixes that hold no lease here are skipped. Returns how many
    /// ended and the bytes freed.
    pub fn end_leases(&self, job: &str, prefixes: &[String]) -> Result<(usize, u64), StoreError> {
        for prefix in prefixes {
            check_name("prefix", prefix, KEY_MAX_BYTES - 1)?;
        }
        let ended = self.shared.leases.end(job, prefixes);
        let bytes = ended.iter().map(|p| self.free_prefix(job, p, true)).sum();
        Ok((ended.len(), bytes))
    }

    /// Free what `job` holds under `<prefix>/` in every bucket and emit `lease_expired`
    /// (without `always`, only when it deleted records).
    fn free_prefix(&self, job: &str, prefix: &str, always: bool) -> u64 {
        let scope = format!("{prefix}/");
        let buckets: Vec<String> = self.job(job).map_or_else(Vec::new, |j| {
            j.buckets
                .read()
                .expect("bucket map lock poisoned")
                .keys()
                .cloned()
                .collect()
        });
        let (deleted, bytes) = buckets
            .iter()
            .filter_map(|bucket| self.delete_prefix(job, bucket, &scope).ok())
            .fold((0, 0), |(n, b), (count, bytes)| (n + count, b + bytes));
        if always || deleted > 0 {
            self.shared
                .events
                .emit(job, "", prefix, EventOp::LeaseExpired);
        }
        bytes
    }
}
