//! Capability checks: token verification per request, the admin token, the per-job epoch table
//! that turns requests with an old weight map into `stale_epoch`, and the jobs the control plane
//! ended here, whose writes are `job_not_registered` however valid their token.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, RwLock};

use pocketflow_protocol::limits::ADMIN_JOB_ID;
use pocketflow_protocol::token::{now_unix_ms, TokenKey};
use pocketflow_protocol::{Context, TokenError};

use crate::bounds::{ENDED_JOBS_MAX, EPOCH_TABLE_JOBS_MAX};
use crate::status::ServiceError;

/// A job's current epoch and weight map.
#[derive(Clone, Debug)]
struct JobEpoch {
    epoch: u64,
    map_json: Arc<str>,
}

/// The jobs a server knows of: current epochs, and the jobs ended here (oldest first).
#[derive(Debug, Default)]
struct JobTable {
    epochs: HashMap<String, JobEpoch>,
    ended: HashSet<String>,
    ended_order: VecDeque<String>,
}

impl JobTable {
    fn check_not_ended(&self, job: &str) -> Result<(), ServiceError> {
        if self.ended.contains(job) {
            return Err(ServiceError::JobEnded {
                job: job.to_owned(),
            });
        }
        Ok(())
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
    jobs: RwLock<JobTable>,
}

impl Authority {
    /// An authority that verifies tokens with `key`.
    pub fn new(key: TokenKey) -> Self {
        Self {
            key,
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
        self.check_epoch(&ctx.job, ctx.epoch)?;
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

    /// Fail with `job_not_registered` if the job was ended here: what is left of an ended job (its
    /// PERSIST objects) can still be read and deleted with its token, but nothing new is written.
    pub fn check_may_write(&self, job: &str) -> Result<(), ServiceError> {
        self.jobs
            .read()
            .expect("job table lock")
            .check_not_ended(job)
    }

    /// Fail with `stale_epoch` if `epoch` is older than the job's current epoch.
    pub fn check_epoch(&self, job: &str, epoch: u64) -> Result<(), ServiceError> {
        let jobs = self.jobs.read().expect("job table lock");
        match jobs.epochs.get(job) {
            Some(current) if epoch < current.epoch => Err(ServiceError::StaleEpoch {
                map_json: current.map_json.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// Record a job's current epoch and map. Epochs only move forward: an older one fails with
    /// `stale_epoch` carrying the current map.
    pub fn set_epoch(&self, job: &str, epoch: u64, map_json: String) -> Result<(), ServiceError> {
        let mut jobs = self.jobs.write().expect("job table lock");
        jobs.check_not_ended(job)?;
        let epochs = &mut jobs.epochs;
        if let Some(current) = epochs.get(job) {
            if epoch < current.epoch {
                return Err(ServiceError::StaleEpoch {
                    map_json: current.map_json.clone(),
                });
            }
        } else if epochs.len() >= EPOCH_TABLE_JOBS_MAX {
            return Err(ServiceError::ResourceBound {
                what: "jobs in the epoch table",
                max: EPOCH_TABLE_JOBS_MAX,
            });
        }
        epochs.insert(
            job.to_owned(),
            JobEpoch {
                epoch,
                map_json: map_json.into(),
            },
        );
        Ok(())
    }

    /// End a job here (the control plane deregistered it): forget its epoch, and refuse every later
    /// write of it (a put, a block upload, a new bucket, a new epoch) with `job_not_registered`, so
    /// a straggler task cannot bring the job back with data that nothing would free. Remembers at
    /// most `ENDED_JOBS_MAX` jobs.
    pub fn end(&self, job: &str) {
        let mut jobs = self.jobs.write().expect("job table lock");
        jobs.epochs.remove(job);
        if jobs.ended.insert(job.to_owned()) {
            jobs.ended_order.push_back(job.to_owned());
            if jobs.ended_order.len() > ENDED_JOBS_MAX {
                if let Some(oldest) = jobs.ended_order.pop_front() {
                    jobs.ended.remove(&oldest);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pocketflow_protocol::ErrorKind;

    fn authority() -> (Authority, TokenKey) {
        let key = TokenKey::new(b"0123456789abcdef").unwrap();
        (Authority::new(key.clone()), key)
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
    fn an_ended_job_stays_ended_and_the_table_is_bounded() {
        let (auth, _) = authority();
        auth.set_epoch("j", 1, "{}".into()).unwrap();
        auth.end("j");
        auth.end("j");
        assert_eq!(
            auth.set_epoch("j", 2, "{}".into()).unwrap_err().kind(),
            ErrorKind::JobNotRegistered
        );
        assert_eq!(
            auth.check_may_write("j").unwrap_err().kind(),
            ErrorKind::JobNotRegistered
        );
        assert!(auth.check_may_write("other").is_ok());
        for i in 0..ENDED_JOBS_MAX {
            auth.end(&format!("later-{i}"));
        }
        let jobs = auth.jobs.read().unwrap();
        assert_eq!(jobs.ended.len(), ENDED_JOBS_MAX);
        assert_eq!(jobs.ended_order.len(), ENDED_JOBS_MAX);
        drop(jobs);
        // The oldest ended job was forgotten to keep the bound.
        assert!(auth.check_may_write("j").is_ok());
        assert!(auth
            .check_may_write(&format!("later-{}", ENDED_JOBS_MAX - 1))
            .is_err());
    }
}
