//! Block 0 of an object (its record: a small object's value, or a large object's manifest), found
//! where it lives: at its home, then on the PERSIST placement, and once the map has changed
//! (epoch > 1) on every other server in rendezvous order, because data never moves when a job is
//! resized. Once the job has lost a server, a key that no live server holds is "unavailable", not
//! "not found". Also the batched form (one pipelined session per server) and the put-back of a
//! record a DELETE read claimed but could not deliver.

use bytes::Bytes;
use pocketflow_protocol::action::{ActionName, ObjectRequest};
use pocketflow_protocol::frame::{OpCode, OP_FLAG_CLAIM_WHOLE, OP_FLAG_DELETE, OP_FLAG_PERSIST};
use pocketflow_protocol::header::ObjectHeader;
use tonic::Code;

use crate::connection::{ExchangeReply, ExchangeRequest};
use crate::error::ClientError;
use crate::failure::{body, failure_reply, kind_of, reply_error, server_error, Failure};
use crate::homes::home;
use crate::objects::{Objects, STALE_EPOCH_RETRIES_MAX};
use crate::parallel::{push_grouped, run_parallel};
use crate::view::{Server, View};

/// A block-0 record as a read found it: where, and the server's reply (status 0).
#[derive(Debug, Clone)]
pub struct Record {
    /// The address of the server that holds it.
    pub server: String,
    /// The object header (absent only in replies that carry none).
    pub header: Option<ObjectHeader>,
    /// A small object's bytes; for a large object, its manifest's value (empty, or the servers
    /// an overflowed object's blocks skipped: `homes::Skipped`).
    pub body: Bytes,
}

impl Record {
    /// The object's size in bytes.
    pub fn size(&self) -> u64 {
        match self.header {
            Some(header) => header.size,
            None => self.body.len() as u64,
        }
    }

    /// Whether the object's bytes are in data blocks rather than in the record.
    pub fn has_blocks(&self) -> bool {
        self.header.is_some_and(|h| h.block_count > 0)
    }
}

enum Probe {
    Found(Record),
    Stale(Failure),
    Missing { bucket_seen: bool },
}

impl Objects {
    /// Run a GET, LOOKUP or DELETE of block 0 where the object lives (see the module doc).
    ///
    /// A GET or LOOKUP that finds the key on no live server of a job that lost servers fails as
    /// unavailable (unless `lost_unavailable` is false: a waiter keeps waiting for such a key).
    pub fn fetch_record(
        &self,
        bucket: &str,
        key: &str,
        op: OpCode,
        flags: u8,
        lost_unavailable: bool,
    ) -> Result<Record, Failure> {
        let request = record_request(bucket, key, op, flags);
        self.fetch_record_with(&request, lost_unavailable, &mut |view, server| {
            self.call_or_stale(view, &server.address, request.clone())
        })
    }

    /// [`Objects::fetch_record`] of `request`, asking block 0's home with `at_home` (the
    /// fallbacks ask with `request` over a session).
    pub(crate) fn fetch_record_with(
        &self,
        request: &ExchangeRequest,
        lost_unavailable: bool,
        at_home: &mut dyn FnMut(&View, &Server) -> Result<ExchangeReply, Failure>,
    ) -> Result<Record, Failure> {
        let (bucket, key, op) = (request.bucket.as_str(), request.key.as_str(), request.op);
        let key_raw = key.as_bytes();
        for attempt in 0..=STALE_EPOCH_RETRIES_MAX {
            let view = self.view();
            let primary = home(&view, key_raw, 0, false)?;
            let reply = at_home(&view, primary)?;
            // A fence is "not here": the record it stands for is on the PERSIST home.
            let fence = reply.header.filter(|h| reply.status == 0 && h.fence());
            if reply.status == 0 && fence.is_none() {
                return Ok(Record {
                    server: primary.address.clone(),
                    header: reply.header,
                    body: reply.body,
                });
            }
            let error = match fence {
                Some(_) => server_error(
                    Code::NotFound as i32,
                    "not_found",
                    format!("{bucket}/{key}"),
                ),
                None => reply_error(&reply),
            };
            if error.is_stale_epoch() {
                self.adopt_or_fail(Failure::at(error, &primary.address), attempt)?;
                continue;
            }
            if !error.is_not_found() {
                return Err(Failure::at(error, &primary.address));
            }
            // A read with DELETE took the fence: put it back unless the record it stood for
            // turns out gone, or taken by this read.
            let taken = fence.filter(|_| takes(request));
            let probed = self
                .probe_fallbacks(&view, primary, key_raw, request)
                .inspect_err(|_| {
                    if let Some(fence) = taken {
                        self.restore_fence(&view, request, &primary.address, fence);
                    }
                })?;
            match probed {
                Probe::Found(record) => return Ok(record),
                Probe::Stale(stale) => {
                    if let Some(fence) = taken {
                        self.restore_fence(&view, request, &primary.address, fence);
                    }
                    self.adopt_or_fail(stale, attempt)?;
                    continue;
                }
                Probe::Missing { bucket_seen } => {
                    if let Some((error, server)) =
                        view.suspect_error(key_raw, &format!("{bucket}/{key}"))
                    {
                        return Err(Failure { error, server });
                    }
                    let mut error = error;
                    if kind_of(&error) == "bucket_not_found" && bucket_seen {
                        error = server_error(
                            Code::NotFound as i32,
                            "not_found",
                            format!("{bucket}/{key}"),
                        );
                    }
                    if kind_of(&error) == "not_found" && op != OpCode::Delete && lost_unavailable {
                        if let Some((lost, server)) = view.lost_error(&format!("{bucket}/{key}")) {
                            return Err(Failure {
                                error: lost,
                                server,
                            });
                        }
                    }
                    return Err(Failure::at(error, &primary.address));
                }
            }
        }
        unreachable!("the last attempt returns")
    }

    /// Put back the fence `fence` a read with DELETE took from `address` (best effort).
    fn restore_fence(
        &self,
        view: &View,
        request: &ExchangeRequest,
        address: &str,
        fence: ObjectHeader,
    ) {
        let put = ExchangeRequest {
            op: OpCode::Put,
            flags: 0,
            bucket: request.bucket.clone(),
            key: request.key.clone(),
            header: fence,
            value: Bytes::new(),
        };
        let _ = self.call(view, address, put);
    }

    /// Try block 0 on the PERSIST placement, then (epoch > 1) every other server but the
    /// suspects (which may hang; the caller says if one may hold the key).
    fn probe_fallbacks(
        &self,
        view: &View,
        primary: &Server,
        key: &[u8],
        request: &ExchangeRequest,
    ) -> Result<Probe, Failure> {
        let mut candidates: Vec<&Server> = Vec::new();
        if view.placement.has_persist() {
            if let Some(persist) = view.server_for(key, 0, true) {
                if persist.node_id != primary.node_id {
                    candidates.push(persist);
                }
            }
        }
        if view.epoch > 1 {
            let first = candidates.first().map(|s| s.node_id.clone());
            candidates
                .extend(view.ranked(key, 0).filter(|s| {
                    s.node_id != primary.node_id && Some(&s.node_id) != first.as_ref()
                }));
        }
        candidates.retain(|s| !view.is_suspect(&s.node_id));
        let mut bucket_seen = false;
        for server in candidates {
            let reply = match self.call(view, &server.address, request.clone()) {
                Ok(reply) => reply,
                Err(error) if error.is_stale_epoch() => {
                    return Ok(Probe::Stale(Failure::at(error, &server.address)))
                }
                Err(error) => return Err(Failure::at(error, &server.address)),
            };
            if reply.status == 0 && !reply.header.is_some_and(|h| h.fence()) {
                return Ok(Probe::Found(Record {
                    server: server.address.clone(),
                    header: reply.header,
                    body: reply.body,
                }));
            }
            if reply.status == 0 {
                bucket_seen = true; // a fence of an earlier map: the record is elsewhere
                continue;
            }
            let error = reply_error(&reply);
            if error.is_stale_epoch() {
                return Ok(Probe::Stale(Failure::at(error, &server.address)));
            }
            match kind_of(&error) {
                "not_found" => bucket_seen = true,
                "bucket_not_found" => {}
                _ => return Err(Failure::at(error, &server.address)),
            }
        }
        Ok(Probe::Missing { bucket_seen })
    }

    /// Put back a record claimed by a DELETE read whose bytes could not be delivered; returns
    /// why it could not be put back, if it could not.
    pub fn restore_record(
        &self,
        record: &Record,
        bucket: &str,
        key: &str,
    ) -> Result<(), ClientError> {
        let Some(header) = record.header else {
            return Ok(());
        };
        let view = self.view();
        let request = ExchangeRequest {
            op: OpCode::Put,
            flags: if header.persist() { OP_FLAG_PERSIST } else { 0 },
            bucket: bucket.to_string(),
            key: key.to_string(),
            header,
            // A small object's bytes, or the value of a manifest (an overflowed one's list of
            // skipped servers; empty otherwise).
            value: record.body.clone(),
        };
        let reply = self.call(&view, &record.server, request)?;
        if reply.status == 0 {
            Ok(())
        } else {
            Err(reply_error(&reply))
        }
    }

    /// Take the record of a striped object a DELETE read has just read whole (the read left
    /// it in place: `OP_FLAG_CLAIM_WHOLE`): a `delete` of its version where it was found, then
    /// free its data blocks. `None` when this reader took it and may return the bytes; the
    /// `not_found` failure when it lost (another reader took the version first, or an
    /// overwrite replaced it; the winner frees the blocks).
    pub fn claim_record(
        &self,
        record: &Record,
        bucket: &str,
        key: &str,
    ) -> Result<Option<Failure>, Failure> {
        let Some(header) = record.header else {
            return Ok(None);
        };
        let address = record.server.as_str();
        for attempt in 0..=STALE_EPOCH_RETRIES_MAX {
            let view = self.view();
            let request = ObjectRequest {
                ctx: view.ctx.clone(),
                bucket: bucket.to_string(),
                key: key.to_string(),
                version: Some(header.version),
            };
            match self.action(address, ActionName::Delete, body(&request)) {
                Ok(_) => {
                    self.delete_blocks(bucket, key, &header);
                    return Ok(None);
                }
                Err(error) if error.is_not_found() => {
                    return Ok(Some(Failure::at(error, address)));
                }
                Err(error) if error.is_stale_epoch() => {
                    self.adopt_or_fail(Failure::at(error, address), attempt)?;
                }
                Err(error) => return Err(Failure::at(error, address)),
            }
        }
        unreachable!("the last attempt returns")
    }

    /// [`Objects::claim_record`] of many striped objects read whole, `io_threads` at once; each
    /// one's outcome in order.
    pub fn claim_records(
        &self,
        bucket: &str,
        claims: &[(&str, &Record)],
    ) -> Vec<Result<Option<Failure>, Failure>> {
        run_parallel(claims, self.io_threads.max(1), |(key, record)| {
            self.claim_record(record, bucket, key)
        })
    }

    /// Run `op` on block 0 of every key at its home (no fallbacks), pipelined over one session
    /// per server, all servers at once, adopting newer maps; each key's outcome in order, "not
    /// found" answers included as they came.
    fn on_homes(
        &self,
        bucket: &str,
        keys: &[&str],
        op: OpCode,
        flags: u8,
    ) -> Vec<Result<Record, Failure>> {
        let mut results: Vec<Option<Result<Record, Failure>>> = vec![None; keys.len()];
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        for attempt in 0..=STALE_EPOCH_RETRIES_MAX {
            let view = self.view();
            let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
            for &index in &pending {
                match home(&view, keys[index].as_bytes(), 0, false) {
                    Ok(server) => push_grouped(&mut groups, &server.address, index),
                    Err(failure) => results[index] = Some(Err(failure)),
                }
            }
            let outcomes = run_parallel(
                &groups.iter().collect::<Vec<_>>(),
                groups.len(),
                |(address, group)| {
                    let requests: Vec<ExchangeRequest> = group
                        .iter()
                        .map(|&index| ExchangeRequest {
                            op,
                            flags,
                            bucket: bucket.to_string(),
                            key: keys[index].to_string(),
                            header: ObjectHeader::default(),
                            value: Bytes::new(),
                        })
                        .collect();
                    self.exchange(&view, address, &requests)
                },
            );
            let mut retry = Vec::new();
            let mut stale: Option<Failure> = None;
            for ((address, group), outcome) in groups.iter().zip(outcomes) {
                // A session that failed before its replies came fails each of its ops alike.
                let replies = match outcome {
                    Ok(replies) => replies,
                    Err(error) => vec![failure_reply(&error); group.len()],
                };
                for (&index, reply) in group.iter().zip(replies) {
                    if reply.status == 0 {
                        results[index] = Some(Ok(Record {
                            server: address.to_string(),
                            header: reply.header,
                            body: reply.body,
                        }));
                        continue;
                    }
                    let error = reply_error(&reply);
                    if error.is_stale_epoch() && attempt < STALE_EPOCH_RETRIES_MAX {
                        stale = Some(Failure::at(error, address));
                        retry.push(index);
                    } else {
                        results[index] = Some(Err(Failure::at(error, address)));
                    }
                }
            }
            if let Some(stale) = stale {
                if let Err(failure) = self.adopt_or_fail(stale, attempt) {
                    for index in retry.drain(..) {
                        results[index] = Some(Err(failure.clone()));
                    }
                }
            }
            pending = retry;
            if pending.is_empty() {
                break;
            }
        }
        results
            .into_iter()
            .map(|r| r.expect("every key has an outcome"))
            .collect()
    }

    /// Block 0 of many objects, in the order of `keys`: pipelined over one session per server,
    /// all servers at once; a key missing from its home is then looked for like
    /// [`Objects::fetch_record`] does, one key at a time. With `delete` a small object's record
    /// is claimed as it is read; a striped object's stays (`OP_FLAG_CLAIM_WHOLE`) for its
    /// reader to take with [`Objects::claim_records`] once its blocks are read.
    pub fn fetch_records(
        &self,
        bucket: &str,
        keys: &[&str],
        delete: bool,
    ) -> Vec<Result<Record, Failure>> {
        let flags = if delete {
            OP_FLAG_DELETE | OP_FLAG_CLAIM_WHOLE
        } else {
            0
        };
        let mut results = self.on_homes(bucket, keys, OpCode::Get, flags);
        // Fallback placements (PERSIST, earlier maps) are probed one key at a time, and so are
        // the records behind the fences found at the homes.
        for (index, result) in results.iter_mut().enumerate() {
            let fenced = matches!(result, Ok(record) if record.header.is_some_and(|h| h.fence()));
            if fenced || matches!(result, Err(failure) if failure.error.is_not_found()) {
                *result = self.fetch_record(bucket, keys[index], OpCode::Get, flags, true);
            }
        }
        results
    }

    /// Whether each key's record is at its home (a LOOKUP there, no fallbacks): `Ok` where it
    /// is, else the answer (`not_found`, `bucket_not_found`, ...). One pipelined round trip per
    /// server: what a waiter checks before parking.
    pub fn lookup_homes(&self, bucket: &str, keys: &[&str]) -> Vec<Result<(), Failure>> {
        self.on_homes(bucket, keys, OpCode::Lookup, 0)
            .into_iter()
            .map(|r| r.map(|_| ()))
            .collect()
    }
}

/// The exchange request of a block-0 op of `key` (GET, LOOKUP, DELETE) with `flags`.
pub(crate) fn record_request(bucket: &str, key: &str, op: OpCode, flags: u8) -> ExchangeRequest {
    ExchangeRequest {
        op,
        flags,
        bucket: bucket.to_string(),
        key: key.to_string(),
        header: ObjectHeader::default(),
        value: Bytes::new(),
    }
}

/// Whether `request` takes the record it finds (a DELETE, or a GET with DELETE).
fn takes(request: &ExchangeRequest) -> bool {
    request.op == OpCode::Delete
        || (request.op == OpCode::Get
            && request.flags & pocketflow_protocol::frame::OP_FLAG_DELETE != 0)
}
