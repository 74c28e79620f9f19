//! Waiting for other tasks' objects (`Client.wait_for`): keys already written are found at their
//! homes by one pipelined LOOKUP per server; only the keys still missing are parked on the servers
//! that will hold them (the `wait` action), every server at once, so a reader neither polls with
//! `not_found` nor sleeps longer than its last key takes to arrive.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use pocketflow_protocol::action::{ActionName, WaitRequest, WaitResult};
use pocketflow_protocol::context::Context;
use pocketflow_protocol::frame::OpCode;
use pocketflow_protocol::limits::{WAIT_KEYS_MAX, WAIT_TIMEOUT_MAX_MS};

use crate::connection::Connection;
use crate::error::ClientError;
use crate::failure::{body, Failure};
use crate::homes::home;
use crate::objects::{Objects, STALE_EPOCH_RETRIES_MAX};
use crate::parallel::{push_grouped, run_parallel};
use crate::writes::kind_is;

/// How much shorter than the client's RPC timeout one parked call is: the server answers a
/// parked call when its time is up, and that answer must reach the client before it gives up.
const PARKED_CALL_MARGIN: Duration = Duration::from_secs(1);

/// How a waiter is asked whether its caller gave up: `asked` is called every `interval` while
/// calls are parked, and `true` ends the wait.
#[derive(Clone, Copy)]
pub struct Stop<'a> {
    /// Whether the caller gave up.
    pub asked: &'a (dyn Fn() -> bool + Sync),
    /// How often `asked` is called.
    pub interval: Duration,
}

/// How one server's part of a wait ended.
enum Parked {
    /// The keys of the part still missing when it returned.
    Missing(Vec<String>),
    /// The server has a newer map: adopt it and place the part again.
    Stale(Failure),
}

impl Objects {
    /// Block until every key of `keys` exists in `bucket` or `timeout` passes; returns the
    /// indices (into `keys`, ascending) of the keys still missing. Duplicate keys are awaited
    /// once; a missing duplicate is reported at its first index.
    ///
    /// Up to `exchange_window` keys are first looked up at their homes, one round trip per
    /// server; with a zero `timeout` that is the whole check. Once the job's map has changed
    /// (epoch > 1) a key not at its home is also looked for where an earlier map put it. The
    /// keys still missing are parked on their homes' servers, all at once, each call at most
    /// `WAIT_TIMEOUT_MAX_MS` and within the RPC timeout; a server with a newer map makes the
    /// client adopt it and place those keys again. Fails on a server that cannot be reached,
    /// a missing bucket, and any other error a server answers.
    ///
    /// While calls are parked, `stop` is asked every `stop_interval` whether the caller gave up
    /// (a Python caller's Ctrl-C); if it says so, the calls are dropped (which cancels their
    /// RPCs) and the wait returns `None`.
    pub fn wait_for(
        &self,
        bucket: &str,
        keys: &[&str],
        timeout: Duration,
        stop: Stop<'_>,
    ) -> Result<Option<Vec<usize>>, Failure> {
        let deadline = Instant::now() + timeout;
        let mut first_index: HashMap<&str, usize> = HashMap::with_capacity(keys.len());
        let mut wanted: Vec<usize> = Vec::with_capacity(keys.len());
        for (index, key) in keys.iter().enumerate() {
            if first_index.insert(key, index).is_none() {
                wanted.push(index);
            }
        }
        // Every key found or not found at its home: the lookups were the whole check.
        let mut settled = false;
        if wanted.len() <= self.exchange_window {
            settled = true;
            let looked: Vec<&str> = wanted.iter().map(|&index| keys[index]).collect();
            let outcomes = self.lookup_homes(bucket, &looked);
            let mut missing = Vec::with_capacity(wanted.len());
            for (index, outcome) in wanted.iter().zip(outcomes) {
                match outcome {
                    Ok(()) => {}
                    Err(failure) if kind_is(&failure.error, "not_found") => missing.push(*index),
                    // A missing bucket or a newer map: the wait action sorts it out.
                    Err(failure)
                        if failure.error.is_not_found() || failure.error.is_stale_epoch() =>
                    {
                        settled = false;
                        missing.push(*index);
                    }
                    Err(failure) => return Err(failure),
                }
            }
            wanted = missing;
        }
        if !wanted.is_empty() && self.view().epoch > 1 {
            // Each key is looked for where earlier maps put it too, on the I/O threads.
            let found = run_parallel(&wanted, self.io_threads, |index| {
                self.fetch_record(bucket, keys[index], OpCode::Lookup, 0, false)
            });
            let mut missing = Vec::with_capacity(wanted.len());
            for (index, outcome) in wanted.into_iter().zip(found) {
                match outcome {
                    Ok(_) => {}
                    Err(failure) if kind_is(&failure.error, "not_found") => missing.push(index),
                    Err(failure) => return Err(failure),
                }
            }
            wanted = missing;
        }
        if wanted.is_empty() || (timeout.is_zero() && settled) {
            return Ok(Some(wanted));
        }
        let call_max = self
            .config
            .rpc_timeout
            .saturating_sub(PARKED_CALL_MARGIN)
            .min(Duration::from_millis(WAIT_TIMEOUT_MAX_MS))
            .max(Duration::from_millis(1));
        let mut missing = wanted;
        for attempt in 0..=STALE_EPOCH_RETRIES_MAX {
            let view = self.view();
            let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
            for &index in &missing {
                let server = home(&view, keys[index].as_bytes(), 0, false)?;
                push_grouped(&mut groups, &server.address, index);
            }
            let parts: Vec<(&str, &[usize])> = groups
                .iter()
                .flat_map(|(address, group)| {
                    group
                        .chunks(WAIT_KEYS_MAX)
                        .map(move |chunk| (*address, chunk))
                })
                .collect();
            let mut calls = Vec::with_capacity(parts.len());
            for &(address, part) in &parts {
                let connection = self
                    .connection(address)
                    .map_err(|error| Failure::at(error, address))?;
                let part_keys: Vec<String> = part.iter().map(|&i| keys[i].to_string()).collect();
                calls.push(park(
                    connection,
                    address,
                    Parking {
                        ctx: view.ctx.clone(),
                        bucket,
                        deadline,
                        call_max,
                    },
                    part_keys,
                ));
            }
            let Some(outcomes) = crate::block_on(async {
                let all = join_all(calls);
                tokio::pin!(all);
                loop {
                    tokio::select! {
                        outcomes = &mut all => return Some(outcomes),
                        () = tokio::time::sleep(stop.interval) => {
                            if (stop.asked)() {
                                return None;
                            }
                        }
                    }
                }
            }) else {
                return Ok(None);
            };
            let mut stale: Option<Failure> = None;
            let mut still = Vec::with_capacity(missing.len());
            for ((_, part), outcome) in parts.iter().zip(outcomes) {
                match outcome? {
                    Parked::Missing(left) => {
                        still.extend(left.iter().filter_map(|key| first_index.get(key.as_str())))
                    }
                    Parked::Stale(failure) => {
                        stale.get_or_insert(failure);
                        still.extend_from_slice(part);
                    }
                }
            }
            still.sort_unstable();
            missing = still;
            match stale {
                Some(stale) if !missing.is_empty() => self.adopt_or_fail(stale, attempt)?,
                _ => return Ok(Some(missing)),
            }
        }
        unreachable!("the last attempt returns or fails")
    }
}

/// What every parked call of one wait shares.
struct Parking<'a> {
    ctx: Context,
    bucket: &'a str,
    deadline: Instant,
    /// Longest one call is parked.
    call_max: Duration,
}

/// Park `keys` on `connection`'s server (at `address`) until they all exist or the deadline
/// passes, in calls of at most `call_max`.
async fn park(
    connection: Arc<Connection>,
    address: &str,
    parking: Parking<'_>,
    keys: Vec<String>,
) -> Result<Parked, Failure> {
    let mut left = keys;
    loop {
        let left_time = parking.deadline.saturating_duration_since(Instant::now());
        let request = WaitRequest {
            ctx: parking.ctx.clone(),
            bucket: parking.bucket.to_string(),
            keys: left.clone(),
            timeout_ms: left_time.min(parking.call_max).as_millis() as u64,
        };
        let answer = match connection
            .action(ActionName::Wait.as_str(), body(&request))
            .await
        {
            Ok(answer) => answer,
            Err(error) if error.is_stale_epoch() => {
                return Ok(Parked::Stale(Failure::at(error, address)))
            }
            Err(error) => return Err(Failure::at(error, address)),
        };
        let result: WaitResult = serde_json::from_slice(&answer).map_err(|e| {
            Failure::at(ClientError::Protocol(format!("wait answer: {e}")), address)
        })?;
        left = result.missing;
        if left.is_empty() || left_time <= parking.call_max {
            return Ok(Parked::Missing(left));
        }
    }
}
