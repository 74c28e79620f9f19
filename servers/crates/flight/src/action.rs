//! DoAction handlers: object and bucket management for jobs, and the control-plane actions
//! (`set_epoch`, `stats`, `drain`, `set_cores`) for the admin.

use bytes::Bytes;
use pocketflow_protocol::action::{
    ActionName, AnyRequest, BucketRequest, CapacityRefusals, DeleteBlocksRequest, DeleteJobRequest,
    DeletedResult, DrainRequest, DrainResult, EnumerateRequest, EnumerateResult, FreedResult,
    HeaderJson, JobUsageJson, KeyEntry, ObjectRequest, PrefixRequest, SetCoresRequest,
    SetCoresResult, SetEpochRequest, StatsReport, WaitRequest, WaitResult,
};
use pocketflow_protocol::action::{
    EndLeasesRequest, EndLeasesResult, EventJson, EventsRequest, EventsResult, RenewLeasesRequest,
    RenewLeasesResult, SubscribeRequest, SubscribeResult,
};
use pocketflow_protocol::context::{check_job_id, parse_json};
use pocketflow_protocol::ProtocolError;
use pocketflow_store::events::EventOp;
use pocketflow_store::RefusalCounts;
use serde::Serialize;

use tokio::time::{Duration, Instant};

use crate::bounds::WAITS_PARKED_MAX;
use crate::service::ServiceState;
use crate::status::ServiceError;

fn json<T: Serialize>(value: &T) -> Bytes {
    Bytes::from(serde_json::to_vec(value).expect("action results serialize"))
}

/// Run one action and return its single JSON result body.
pub(crate) async fn run(
    state: &ServiceState,
    action_type: &str,
    body: &[u8],
) -> Result<Bytes, ServiceError> {
    let action = ActionName::from_name(action_type)?;
    state.stats.counters.add_ops(1);
    // Authorize on the ctx alone first, so a caller without a valid token learns nothing from
    // the validation of the rest of the body.
    let ctx = parse_json::<AnyRequest>("action body", body)?.ctx;
    if action.admin_only() {
        state.auth.admin(&ctx, action.as_str())?;
    } else if action != ActionName::DeleteJob || !state.auth.is_admin(&ctx) {
        state.auth.job(&ctx)?;
    }
    if action.is_write() {
        state.drain.check_write(&state.node_id)?;
        state.auth.check_may_write(&ctx.job)?;
    }
    let job = ctx.job.as_str();
    let store = &state.store;
    match action {
        ActionName::Lookup => {
            let req = ObjectRequest::parse(body)?;
            Ok(json(&HeaderJson::from(store.lookup(
                job,
                &req.bucket,
                &req.key,
            )?)))
        }
        ActionName::Delete => {
            let req = ObjectRequest::parse(body)?;
            Ok(json(&HeaderJson::from(store.delete_record_version(
                job,
                &req.bucket,
                &req.key,
                req.version,
            )?)))
        }
        ActionName::DeleteBlocks => {
            let req = DeleteBlocksRequest::parse(body)?;
            let freed_bytes =
                store.delete_blocks(job, &req.bucket, &req.key, req.version, &req.blocks)?;
            Ok(json(&FreedResult { freed_bytes }))
        }
        ActionName::Enumerate => {
            let req = EnumerateRequest::parse(body)?;
            let (keys, truncated) = store.enumerate(
                job,
                &req.bucket,
                &req.prefix,
                req.start_after.as_deref(),
                req.limit,
            )?;
            let keys = keys
                .into_iter()
                .map(|(key, size)| KeyEntry { key, size })
                .collect();
            Ok(json(&EnumerateResult { keys, truncated }))
        }
        ActionName::CreateBucket => {
            let req = BucketRequest::parse(body)?;
            store.create_bucket(job, &req.bucket)?;
            Ok(json(&serde_json::json!({})))
        }
        ActionName::DeleteBucket => {
            let req = BucketRequest::parse(body)?;
            let freed_bytes = store.delete_bucket(job, &req.bucket)?;
            store.wake_waiters();
            Ok(json(&FreedResult { freed_bytes }))
        }
        ActionName::DeletePrefix => {
            let req = PrefixRequest::parse(body)?;
            let (deleted, freed_bytes) = store.delete_prefix(job, &req.bucket, &req.prefix)?;
            Ok(json(&DeletedResult {
                deleted,
                freed_bytes,
            }))
        }
        ActionName::DeleteJob => delete_job(state, body),
        ActionName::SetEpoch => {
            let req = SetEpochRequest::parse(body)?;
            let reserved_bytes = req.reserved_bytes(&state.node_id)?;
            state.auth.set_epoch(&req.job, req.epoch, req.map_json()?)?;
            state
                .store
                .set_reservation(&req.job, req.epoch, reserved_bytes);
            // A job ended meanwhile (`delete_job` released its reservation before this set it
            // again) holds none: its end is final here.
            if state.auth.check_may_write(&req.job).is_err() {
                state.store.end_reservation(&req.job);
            }
            Ok(json(&serde_json::json!({})))
        }
        ActionName::Stats => Ok(json(&stats_report(state))),
        ActionName::Drain => {
            let req = DrainRequest::parse(body)?;
            state.drain.start(req.exit_when_empty);
            Ok(json(&DrainResult { draining: true }))
        }
        ActionName::SetCores => {
            let req = SetCoresRequest::parse(body)?;
            let cores = crate::cores::get();
            let now = cores.set(req.cores as usize)?;
            Ok(json(&SetCoresResult {
                cores: now as u32,
                cores_max: cores.max() as u32,
            }))
        }
        ActionName::Wait => wait(state, job, body).await,
        ActionName::Subscribe => {
            let req = SubscribeRequest::parse(body)?;
            // A subscription holds server memory for the job: only a registered job's.
            state.auth.check_may_write(job)?;
            let ops = req
                .ops
                .iter()
                .map(|name| {
                    EventOp::from_name(name).ok_or(ProtocolError::Field {
                        what: "ops",
                        why: "names put, delete, enqueue, dequeue or lease_expired",
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let subscription =
                store
                    .events()
                    .subscribe(job, &req.bucket, &req.prefix, &ops, req.capacity)?;
            Ok(json(&SubscribeResult { subscription }))
        }
        ActionName::Events => {
            let req = EventsRequest::parse(body)?;
            let _permit = state.waits.clone().try_acquire_owned().map_err(|_| {
                ServiceError::ResourceBound {
                    what: "parked waits",
                    max: WAITS_PARKED_MAX,
                }
            })?;
            let (events, dropped) = store
                .events()
                .poll(
                    job,
                    req.subscription,
                    req.max,
                    Duration::from_millis(req.timeout_ms),
                    req.keep.then_some(req.acked),
                )
                .await?;
            let events = events
                .into_iter()
                .map(|e| EventJson {
                    seq: e.seq,
                    op: e.op.as_str().to_string(),
                    bucket: e.bucket,
                    key: e.key,
                })
                .collect();
            Ok(json(&EventsResult { events, dropped }))
        }
        ActionName::Unsubscribe => {
            let req = EventsRequest::parse(body)?;
            store.events().unsubscribe(job, req.subscription)?;
            Ok(json(&serde_json::json!({})))
        }
        ActionName::RenewLeases => {
            let req = RenewLeasesRequest::parse(body)?;
            // Only a registered job holds leases: an ended job's went with it.
            state.auth.check_may_write(job)?;
            let leases = store.renew_leases(job, &req.prefixes, req.lease_ms)?;
            Ok(json(&RenewLeasesResult { leases }))
        }
        ActionName::EndLeases => {
            let req = EndLeasesRequest::parse(body)?;
            let (ended, freed_bytes) = store.end_leases(job, &req.prefixes)?;
            Ok(json(&EndLeasesResult { ended, freed_bytes }))
        }
    }
}

/// `wait`: park until every named key has a block-0 record or `timeout_ms` passes, then return
/// the keys still missing. Readers of a shuffle wait here instead of polling with `not_found`;
/// an insert wakes only the parked calls watching its key, and each re-checks its missing keys.
async fn wait(state: &ServiceState, job: &str, body: &[u8]) -> Result<Bytes, ServiceError> {
    let req = WaitRequest::parse(body)?;
    let _permit =
        state
            .waits
            .clone()
            .try_acquire_owned()
            .map_err(|_| ServiceError::ResourceBound {
                what: "parked waits",
                max: WAITS_PARKED_MAX,
            })?;
    let deadline = Instant::now() + Duration::from_millis(req.timeout_ms);
    let mut missing = req.keys;
    let mut waiter = state.store.waiter(job, &req.bucket);
    loop {
        // Watch before checking, so an insert in between is not lost.
        waiter.watch(&missing);
        missing = state.store.missing(job, &req.bucket, &missing)?;
        if missing.is_empty() || Instant::now() >= deadline {
            return Ok(json(&WaitResult { missing }));
        }
        // Woken by an insert of a watched key, by a bucket or job going away, or at the
        // deadline: the next round re-checks either way (and returns at the deadline).
        let _ = tokio::time::timeout_at(deadline, waiter.notified()).await;
    }
}

/// `delete_job`: a job frees its own data; the admin (the control plane deregistering a job)
/// frees the data of the job it names and ends that job here (`Authority::end`), and with
/// `persist` also frees the job's PERSIST data.
fn delete_job(state: &ServiceState, body: &[u8]) -> Result<Bytes, ServiceError> {
    let req = DeleteJobRequest::parse(body)?;
    if req.persist && !state.auth.is_admin(&req.ctx) {
        return Err(ServiceError::AdminRequired("delete_job with persist"));
    }
    let target = if state.auth.is_admin(&req.ctx) {
        let target = req.job.ok_or(ProtocolError::Field {
            what: "job",
            why: "is required with the admin token",
        })?;
        check_job_id(&target)?;
        state.auth.end(&target);
        // The job's reservation here is released with its end.
        state.store.end_reservation(&target);
        target
    } else {
        match req.job {
            Some(other) if other != req.ctx.job => {
                return Err(ServiceError::ForeignJob {
                    token_job: req.ctx.job,
                    target_job: other,
                });
            }
            _ => req.ctx.job,
        }
    };
    let (deleted, freed_bytes) = if req.persist {
        state.store.delete_job_with_persist(&target)
    } else {
        state.store.delete_job(&target)
    };
    state.store.wake_waiters();
    Ok(json(&DeletedResult {
        deleted,
        freed_bytes,
    }))
}

/// The wire form of the store's refusal counts.
fn refusals_json(counts: &RefusalCounts) -> CapacityRefusals {
    CapacityRefusals {
        data: counts.data,
        records: counts.records,
        reserved: counts.reserved,
        extent: counts.extent,
        freeing: counts.freeing,
    }
}

/// The last statistics sample with the store's current capacity and usage.
pub(crate) fn stats_report(state: &ServiceState) -> StatsReport {
    let sample = state.stats.last();
    let usage = state.store.usage();
    let cores = crate::cores::get();
    let (received_bytes_total, sent_bytes_total) = state.stats.counters.totals();
    StatsReport {
        node_id: state.node_id.clone(),
        tier: state.store.tier().as_str().to_owned(),
        long_running: state.store.long_running(),
        draining: state.drain.is_draining(),
        interval_ms: sample.interval_ms,
        cpu_utilization: sample.cpu_utilization,
        bytes_in_per_s: sample.bytes_in_per_s,
        bytes_out_per_s: sample.bytes_out_per_s,
        ops_per_s: sample.ops_per_s,
        throughput_bytes_per_s: state.stats.throughput_bytes_per_s(),
        capacity_bytes: usage.capacity_bytes,
        used_bytes: usage.used_bytes,
        objects: usage.objects,
        channel_entries: usage.channel_entries,
        freeing_bytes: usage.freeing_bytes,
        capacity_refusals: refusals_json(&usage.refusals),
        jobs: usage
            .per_job
            .into_iter()
            .map(|(job, u)| {
                (
                    job,
                    JobUsageJson {
                        used_bytes: u.used_bytes,
                        objects: u.objects,
                        channel_entries: u.channel_entries,
                        reserved_bytes: u.reserved_bytes,
                        capacity_refusals: refusals_json(&u.refusals),
                    },
                )
            })
            .collect(),
        cores: cores.current() as u32,
        cores_max: cores.max() as u32,
        threads: cores.threads() as u32,
        persist_ttl_ms: state
            .store
            .persist_ttl()
            .map_or(0, |ttl| ttl.as_millis() as u64),
        parked_queue_ops: state.store.parked_queue_ops() as u64,
        requests_total: state.metrics.requests_total(),
        received_bytes_total,
        sent_bytes_total,
        pins: crate::pin::stats(state),
    }
}
