//! Capability checks: token verification per request, the admin token, and the job table: the
//! jobs the control plane told this server about (`set_epoch`), whose current epochs turn requests
//! with an old weight map into `stale_epoch` and which are the only jobs whose writes are
//! accepted, and the jobs ended here, remembered only to say so in the refusal.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use pocketflow_protocol::limits::ADMIN_JOB_ID;
use pocketflow_protocol::token::{now_unix_ms, TokenKey};
use pocketflow_protocol::{Context, TokenError};

use crate::bounds::{ENDED_JOBS_MAX, ENDED_JOB_KEPT_MIN_MS, EPOCH_TABLE_JOBS_MAX};
use crate::status::ServiceError;

/// A registered job's current epoch and weight map.
#[derive(Debug)]
struct JobEpoch {
    epoch: u64,
    map_json: Arc<str>,
    /// The latest expiry (Unix ms) of the job's tokens this server verified: how long the job is
    /// remembered once it ends here.
    tokens_until_unix_ms: AtomicU64,
}

/// Jobs ended here, oldest first, each with when it is forgotten (Unix ms). Writes of an ended
/// job are refused because it left the epoch table; this memory only makes the refusal say that
/// the job ended, and refuses a `set_epoch` of it that arrives late.
#[derive(Debug, Default)]
struct EndedJobs {
    forget_at_unix_ms: HashMap<String, u64>,
    order: VecDeque<String>,
}

impl EndedJobs {
    /// Remember `job` until `forget_at_unix_ms`; past `ENDED_JOBS_MAX` the oldest end and those
    /// already due at the front are forgotten.
    fn remember(&mut self, job: &str, forget_at_unix_ms: u64, now_unix_ms: u64) {
        if let Some(at) = self.forget_at_unix_ms.get_mut(job) {
            *at = (*at).max(forget_at_unix_ms);
            return;
        }
        self.forget_at_unix_ms
            .insert(job.to_owned(), forget_at_unix_ms);
        self.order.push_back(job.to_owned());
        while let Some(oldest) = self.order.front() {
            let due = self
                .forget_at_unix_ms
                .get(oldest)
                .is_none_or(|&at| at <= now_unix_ms);
            if !due && self.order.len() <= ENDED_JOBS_MAX {
                break;
            }
            let oldest = self.order.pop_front().expect("a front entry");
            self.forget_at_unix_ms.remove(&oldest);
        }
    }

    fn remembers(&self, job: &str, now_unix_ms: u64) -> bool {
        self.forget_at_unix_ms
            .get(job)
            .is_some_and(|&at| at > now_unix_ms)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.order.len()
    }
}

/// What a server knows of jobs: the registered ones with their epochs, and those ended here.
#[derive(Debug, Default)]
struct JobTable {
    epochs: HashMap<String, JobEpoch>,
    ended: EndedJobs,
}

impl JobTable {
    /// The refusal of a write (or a `set_epoch`) of a job not in the epoch table.
    fn unregistered(&self, job: &str, node_id: &str) -> ServiceError {
        if self.ended.remembers(job, now_unix_ms()) {
            ServiceError::JobEnded {
                job: job.to_owned(),
                node_id: node_id.to_owned(),
            }
        } else {
            ServiceError::JobNotRegistered {
                job: job.to_owned(),
                node_id: node_id.to_owned(),
            }
        }
    }
}

/// A job token a connection verified, with its expiry (see [`Authority::job_kept`]).
#[derive(Debug)]
pub struct KeptToken {
    job: String,
    token: String,
    expiry_unix_ms: u64,
}

/// Verifies capability contexts and holds the job table.
#[derive(Debug)]
pub struct Authority {
    key: TokenKey,
    /// This server's node id, named in refusals.
    node_id: String,
    jobs: RwLock<JobTable>,
}

impl Authority {
    /// An authority of server `node_id` that verifies tokens with `key`; it knows no job yet.
    pub fn new(key: TokenKey, node_id: String) -> Self {
        Self {
            key,
            node_id,
            jobs: RwLock::new(JobTable::default()),
        }
    }

    /// Verify `ctx`'s token; returns its expiry (Unix ms).
    fn verify(&self, ctx: &Context) -> Result<u64, ServiceError> {
        ctx.validate()?;
        self.key
            .verify(&ctx.job, &ctx.token, now_unix_ms())
            .map_err(|e| ServiceError::Protocol(e.into()))
    }

    /// Authorize a job-scoped request: a valid token of `ctx.job` (not the admin job) whose epoch
    /// is current. A request that writes also needs [`Authority::check_may_write`]. Returns the job id every record of the request belongs to.
    pub fn job(&self, ctx: &Context) -> Result<String, ServiceError> {
        self.job_until(ctx).map(|(job, _)| job)
    }

    /// [`Authority::job`], also returning when the token expires (Unix ms), for a session that
    /// outlives the request it was opened with.
    pub fn job_until(&self, ctx: &Context) -> Result<(String, u64), ServiceError> {
        let expiry_unix_ms = self.verify(ctx)?;
        if ctx.job == ADMIN_JOB_ID {
            return Err(ServiceError::ForeignJob {
                token_job: ctx.job.clone(),
                target_job: ADMIN_JOB_ID.into(),
            });
        }
        self.check_epoch_noting(&ctx.job, ctx.epoch, Some(expiry_unix_ms))?;
        Ok((ctx.job.clone(), expiry_unix_ms))
    }

    /// [`Authority::job`] for a request of a connection that keeps the last token it had
    /// verified in `kept`: the same job and token again skip the MAC (the bytes were verified;
    /// their expiry is checked again), any other is verified and kept.
    pub fn job_kept(
        &self,
        ctx: &Context,
        kept: &mut Option<KeptToken>,
    ) -> Result<String, ServiceError> {
        match kept {
            Some(k) if k.job == ctx.job && k.token == ctx.token => {
                Self::check_not_expired(k.expiry_unix_ms)?;
                self.check_epoch(&ctx.job, ctx.epoch)?;
                Ok(ctx.job.clone())
            }
            _ => {
                let (job, expiry_unix_ms) = self.job_until(ctx)?;
                *kept = Some(KeptToken {
                    job: job.clone(),
                    token: ctx.token.clone(),
                    expiry_unix_ms,
                });
                Ok(job)
            }
        }
    }

    /// Fail with `permission_denied` (an expired token) once `expiry_unix_ms`, of a token
    /// verified earlier, has passed.
    pub fn check_not_expired(expiry_unix_ms: u64) -> Result<(), ServiceError> {
        let now_unix_ms = now_unix_ms();
        if now_unix_ms >= expiry_unix_ms {
            return Err(ServiceError::Protocol(
                TokenError::Expired {
                    expiry_unix_ms,
                    now_unix_ms,
                }
                .into(),
            ));
        }
        Ok(())
    }

    /// Authorize a control-plane request: a valid admin token.
    pub fn admin(&self, ctx: &Context, action: &'static str) -> Result<(), ServiceError> {
        self.verify(ctx)?;
        if ctx.job != ADMIN_JOB_ID {
            return Err(ServiceError::AdminRequired(action));
        }
        Ok(())
    }

    /// Whether `ctx` is a valid admin context (without failing).
    pub fn is_admin(&self, ctx: &Context) -> bool {
        ctx.job == ADMIN_JOB_ID && self.verify(ctx).is_ok()
    }

    /// Fail with `job_not_registered` unless the control plane told this server the job's epoch
    /// (`set_epoch`) and has not ended it here since: only a registered job writes. What is left
    /// of an ended job (its PERSIST objects) can still be read and deleted with its token.
    pub fn check_may_write(&self, job: &str) -> Result<(), ServiceError> {
        let jobs = self.jobs.read().expect("job table lock");
        if jobs.epochs.contains_key(job) {
            return Ok(());
        }
        Err(jobs.unregistered(job, &self.node_id))
    }

    /// Fail with `stale_epoch` if `epoch` is older than the job's current epoch. A job the
    /// server was not told about has no epoch to be older than (its reads are served).
    pub fn check_epoch(&self, job: &str, epoch: u64) -> Result<(), ServiceError> {
        self.check_epoch_noting(job, epoch, None)
    }

    /// [`Authority::check_epoch`], also noting the expiry of a token of the job just verified.
    fn check_epoch_noting(
        &self,
        job: &str,
        epoch: u64,
        token_expiry_unix_ms: Option<u64>,
    ) -> Result<(), ServiceError> {
        let jobs = self.jobs.read().expect("job table lock");
        let Some(current) = jobs.epochs.get(job) else {
            return Ok(());
        };
        if let Some(expiry) = token_expiry_unix_ms {
            current
                .tokens_until_unix_ms
                .fetch_max(expiry, Ordering::Relaxed);
        }
        if epoch < current.epoch {
            return Err(ServiceError::StaleEpoch {
                map_json: current.map_json.clone(),
            });
        }
        Ok(())
    }

    /// Record a job's current epoch and map: the job is registered here from now on (its writes
    /// are accepted). Epochs only move forward: an older one fails with `stale_epoch` carrying
    /// the current map. A job ended here (and still remembered) is `job_not_registered`.
    pub fn set_epoch(&self, job: &str, epoch: u64, map_json: String) -> Result<(), ServiceError> {
        let mut jobs = self.jobs.write().expect("job table lock");
        if jobs.ended.remembers(job, now_unix_ms()) {
            return Err(jobs.unregistered(job, &self.node_id));
        }
        let registered = jobs.epochs.len();
        match jobs.epochs.get_mut(job) {
            Some(current) if epoch < current.epoch => Err(ServiceError::StaleEpoch {
                map_json: current.map_json.clone(),
            }),
            Some(current) => {
                current.epoch = epoch;
                current.map_json = map_json.into();
                Ok(())
            }
            None if registered >= EPOCH_TABLE_JOBS_MAX => Err(ServiceError::ResourceBound {
                what: "jobs in the epoch table",
                max: EPOCH_TABLE_JOBS_MAX,
            }),
            None => {
                jobs.epochs.insert(
                    job.to_owned(),
                    JobEpoch {
                        epoch,
                        map_json: map_json.into(),
                        tokens_until_unix_ms: AtomicU64::new(0),
                    },
                );
                Ok(())
            }
        }
    }

    /// End a job here (the control plane deregistered it): it leaves the epoch table, so every
    /// later write of it (a put, a block upload, a new bucket, a lease, a subscription) is
    /// `job_not_registered` and a straggler task cannot bring the job back with data that nothing
    /// would free. It is remembered as ended (for the refusal's message, and to refuse a late
    /// `set_epoch`) until the last of its tokens this server saw expires, and at least
    /// `ENDED_JOB_KEPT_MIN_MS`, among at most `ENDED_JOBS_MAX` ended jobs; forgetting it lets
    /// nothing of it write again.
    pub fn end(&self, job: &str) {
        let mut jobs = self.jobs.write().expect("job table lock");
        let tokens_until_unix_ms = jobs
            .epochs
            .remove(job)
            .map_or(0, |e| e.tokens_until_unix_ms.into_inner());
        let now_unix_ms = now_unix_ms();
        let forget_at_unix_ms =
            tokens_until_unix_ms.max(now_unix_ms.saturating_add(ENDED_JOB_KEPT_MIN_MS));
        jobs.ended.remember(job, forget_at_unix_ms, now_unix_ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pocketflow_protocol::ErrorKind;

    fn authority() -> (Authority, TokenKey) {
        let key = TokenKey::new(b"0123456789abcdef").unwrap();
        (Authority::new(key.clone(), "node-a".into()), key)
    }

    fn ctx(key: &TokenKey, job: &str, epoch: u64) -> Context {
        Context {
            job: job.into(),
            epoch,
            token: key.make(job, now_unix_ms() + 60_000),
        }
    }

    #[test]
    fn a_kept_token_skips_only_the_mac() {
        let (auth, key) = authority();
        let mut kept = None;
        let first = ctx(&key, "j", 1);
        assert_eq!(auth.job_kept(&first, &mut kept).unwrap(), "j");
        assert!(kept.is_some());
        // The same token again: still epoch-checked.
        assert_eq!(auth.job_kept(&first, &mut kept).unwrap(), "j");
        auth.set_epoch("j", 2, "{}".into()).unwrap();
        assert_eq!(
            auth.job_kept(&first, &mut kept).unwrap_err().kind(),
            ErrorKind::StaleEpoch
        );
        // Another job's claim with the kept token's bytes is verified, and refused.
        let mut other = ctx(&key, "j", 2);
        other.job = "k".into();
        assert_eq!(
            auth.job_kept(&other, &mut kept).unwrap_err().kind(),
            ErrorKind::PermissionDenied
        );
        // A kept token that expired is refused without its MAC being checked again.
        let mut expiring = Some(KeptToken {
            job: "j".into(),
            token: "1.00".into(),
            expiry_unix_ms: 1,
        });
        let stale = Context {
            job: "j".into(),
            epoch: 2,
            token: "1.00".into(),
        };
        assert_eq!(
            auth.job_kept(&stale, &mut expiring).unwrap_err().kind(),
            ErrorKind::PermissionDenied
        );
        // A forged token is never kept.
        let mut fresh = None;
        let forged = Context {
            job: "j".into(),
            epoch: 2,
            token: format!("{}.{}", now_unix_ms() + 60_000, "0".repeat(64)),
        };
        assert!(auth.job_kept(&forged, &mut fresh).is_err());
        assert!(fresh.is_none());
    }

    #[test]
    fn job_tokens() {
        let (auth, key) = authority();
        assert_eq!(auth.job(&ctx(&key, "j", 0)).unwrap(), "j");
        let mut wrong = ctx(&key, "j", 0);
        wrong.job = "k".into();
        assert_eq!(
            auth.job(&wrong).unwrap_err().kind(),
            ErrorKind::PermissionDenied
        );
        let expired = Context {
            job: "j".into(),
            epoch: 0,
            token: key.make("j", 1),
        };
        assert_eq!(
            auth.job(&expired).unwrap_err().kind(),
            ErrorKind::PermissionDenied
        );
        assert_eq!(
            auth.job(&ctx(&key, ADMIN_JOB_ID, 0)).unwrap_err().kind(),
            ErrorKind::PermissionDenied
        );
    }

    #[test]
    fn admin_tokens() {
        let (auth, key) = authority();
        assert!(auth.admin(&ctx(&key, ADMIN_JOB_ID, 0), "stats").is_ok());
        assert!(auth.is_admin(&ctx(&key, ADMIN_JOB_ID, 0)));
        assert_eq!(
            auth.admin(&ctx(&key, "j", 0), "stats").unwrap_err().kind(),
            ErrorKind::PermissionDenied
        );
    }

    #[test]
    fn epochs() {
        let (auth, key) = authority();
        auth.set_epoch("j", 3, r#"{"m":3}"#.into()).unwrap();
        let err = auth.job(&ctx(&key, "j", 2)).unwrap_err();
        assert_eq!(err.wire_message(), r#"stale_epoch: {"m":3}"#);
        assert!(auth.job(&ctx(&key, "j", 3)).is_ok());
        assert!(auth.job(&ctx(&key, "j", 9)).is_ok());
        assert_eq!(
            auth.set_epoch("j", 2, "{}".into()).unwrap_err().kind(),
            ErrorKind::StaleEpoch
        );
        auth.set_epoch("j", 4, r#"{"m":4}"#.into()).unwrap();
        assert_eq!(
            auth.job(&ctx(&key, "j", 3)).unwrap_err().wire_message(),
            r#"stale_epoch: {"m":4}"#
        );
        auth.end("j");
        assert!(
            auth.job(&ctx(&key, "j", 0)).is_ok(),
            "reads of what is left stay allowed"
        );
        assert_eq!(
            auth.check_may_write("j").unwrap_err().kind(),
            ErrorKind::JobNotRegistered
        );
    }

    #[test]
    fn only_a_registered_job_writes() {
        let (auth, key) = authority();
        // Never told: its token is valid and its reads are served, its writes refused.
        assert!(auth.job(&ctx(&key, "j", 1)).is_ok());
        let refused = auth.check_may_write("j").unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::JobNotRegistered);
        assert_eq!(
            refused.wire_message(),
            "job_not_registered: job \"j\" is not registered on server node-a (the control \
             plane has not told it the job's epoch)"
        );
        auth.set_epoch("j", 1, "{}".into()).unwrap();
        assert!(auth.check_may_write("j").is_ok());
        assert!(auth.check_may_write("k").is_err());
        auth.end("j");
        assert_eq!(
            auth.check_may_write("j").unwrap_err().wire_message(),
            "job_not_registered: job \"j\" was deregistered: it ended on server node-a, and its \
             tokens no longer write there"
        );
    }

    #[test]
    fn an_ended_job_never_writes_again_however_many_jobs_end_after_it() {
        let (auth, key) = authority();
        auth.set_epoch("j", 1, "{}".into()).unwrap();
        // A token seen before the end keeps the job remembered while it is valid.
        let long = Context {
            job: "j".into(),
            epoch: 1,
            token: key.make("j", now_unix_ms() + 2 * ENDED_JOB_KEPT_MIN_MS),
        };
        auth.job(&long).unwrap();
        auth.end("j");
        auth.end("j");
        assert_eq!(
            auth.set_epoch("j", 2, "{}".into()).unwrap_err().kind(),
            ErrorKind::JobNotRegistered
        );
        let forget_at = auth.jobs.read().unwrap().ended.forget_at_unix_ms["j"];
        assert!(forget_at >= now_unix_ms() + ENDED_JOB_KEPT_MIN_MS + 1_000);
        for i in 0..2 * ENDED_JOBS_MAX {
            auth.set_epoch(&format!("later-{i}"), 1, "{}".into())
                .unwrap();
            auth.end(&format!("later-{i}"));
        }
        let jobs = auth.jobs.read().unwrap();
        assert_eq!(jobs.ended.len(), ENDED_JOBS_MAX);
        assert_eq!(jobs.ended.forget_at_unix_ms.len(), ENDED_JOBS_MAX);
        assert!(jobs.epochs.is_empty());
        drop(jobs);
        // The oldest ended jobs were forgotten to keep the bound, and still write nothing.
        assert_eq!(
            auth.check_may_write("j").unwrap_err().kind(),
            ErrorKind::JobNotRegistered
        );
        assert_eq!(
            auth.check_may_write("later-0").unwrap_err().kind(),
            ErrorKind::JobNotRegistered
        );
    }

    #[test]
    fn ended_jobs_past_their_time_leave_first() {
        let mut ended = EndedJobs::default();
        ended.remember("gone", 10, 5);
        ended.remember("kept", 1_000, 5);
        assert!(ended.remembers("gone", 9));
        assert!(!ended.remembers("gone", 10));
        // The next end, once the front one is due, drops it.
        ended.remember("next", 1_000, 20);
        assert_eq!(ended.len(), 2);
        assert!(!ended.forget_at_unix_ms.contains_key("gone"));
        // Ending again only ever extends the memory.
        ended.remember("kept", 500, 20);
        assert!(ended.remembers("kept", 999));
        assert_eq!(ended.len(), 2);
    }
}
