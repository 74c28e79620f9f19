//! Capability checks: token verification per request, the admin token, and the per-job epoch table
//! that turns requests with an old weight map into `stale_epoch`.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use pocketflow_protocol::limits::ADMIN_JOB_ID;
use pocketflow_protocol::token::{now_unix_ms, TokenKey};
use pocketflow_protocol::{Context, TokenError};

use crate::bounds::EPOCH_TABLE_JOBS_MAX;
use crate::status::ServiceError;

/// A job's current epoch and weight map.
#[derive(Clone, Debug)]
struct JobEpoch {
    epoch: u64,
    map_json: Arc<str>,
}

/// Verifies capability contexts and holds the epoch table.
#[derive(Debug)]
pub struct Authority {
    key: TokenKey,
    epochs: RwLock<HashMap<String, JobEpoch>>,
}

impl Authority {
    /// An authority that verifies tokens with `key`.
    pub fn new(key: TokenKey) -> Self {
        Self {
            key,
            epochs: RwLock::new(HashMap::new()),
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
    /// is current. Returns the job id every record of the request belongs to.
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

    /// Fail with `stale_epoch` if `epoch` is older than the job's current epoch.
    pub fn check_epoch(&self, job: &str, epoch: u64) -> Result<(), ServiceError> {
        let epochs = self.epochs.read().expect("epoch table lock");
        match epochs.get(job) {
            Some(current) if epoch < current.epoch => Err(ServiceError::StaleEpoch {
                map_json: current.map_json.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// Record a job's current epoch and map. Epochs only move forward: an older one fails with
    /// `stale_epoch` carrying the current map.
    pub fn set_epoch(&self, job: &str, epoch: u64, map_json: String) -> Result<(), ServiceError> {
        let mut epochs = self.epochs.write().expect("epoch table lock");
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

    /// Forget a job's epoch (after the control plane deleted the job).
    pub fn forget(&self, job: &str) {
        self.epochs.write().expect("epoch table lock").remove(job);
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
        auth.forget("j");
        assert!(auth.job(&ctx(&key, "j", 0)).is_ok());
    }
}
