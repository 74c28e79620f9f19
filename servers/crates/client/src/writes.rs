//! The write path of a job's client: block-0 records (a small object, or a large object's
//! manifest, the commit point) stored where placement puts them, with write-once per key across
//! placements, and the data blocks of large objects striped over the job's servers (the one data
//! block of a one-block object on its manifest's home, so that its put is one round trip).
//!
//! Write-once holds per key, not per server, with exactly one winner: one server decides each
//! key, and a put claims it there before (or by) storing its record; an overwrite replaces every
//! version of the key (`write_once.rs`).
//!
//! A data write that a server refuses as full goes on to the job's other servers, and the
//! object's manifest names the servers its blocks skipped (`overflow.rs`).

use std::collections::{BTreeSet, HashMap};

use bytes::Bytes;
use pocketflow_protocol::action::{
    ActionName, BucketRequest, DeleteBlocksRequest, EnumerateRequest,
};
use pocketflow_protocol::descriptor::{PutCommit, PutDescriptor, PutStored};
use pocketflow_protocol::frame::{OpCode, OP_FLAG_OVERWRITE, OP_FLAG_PERSIST};
use pocketflow_protocol::header::{ObjectHeader, HEADER_FLAG_PERSIST};
use pocketflow_protocol::limits::SMALL_OBJECT_MAX_BYTES;
use tonic::Code;

use crate::block_reads::LARGE_OBJECTS_IN_FLIGHT_MAX;
use crate::blocks::BlockSlice;
use crate::connection::ExchangeRequest;
use crate::error::ClientError;
use crate::failure::{body, failure_reply, reply_error, Failure};
use crate::homes::{block_home, home, Layout, Skipped};
use crate::objects::{Objects, STALE_EPOCH_RETRIES_MAX};
use crate::overflow::Overflowing;
use crate::parallel::{push_grouped, run_parallel};
use crate::view::{Server, View};
use crate::write_once::{held_on, plan, through_fence_target, Claimed, KeyPlan};

/// `put_many` sends at most this many small objects per round of pipelined sessions.
pub const PUT_MANY_CHUNK_OPS: usize = 4096;
/// ... and at most this many bytes.
pub const PUT_MANY_CHUNK_BYTES: usize = 64 * 1024 * 1024;

/// One block-0 record to store.
#[derive(Debug, Clone)]
pub struct NewRecord<'a> {
    /// Its key.
    pub key: &'a str,
    /// Its header (version, size, layout, flags).
    pub header: ObjectHeader,
    /// A small object's bytes (empty for a manifest).
    pub value: &'a [u8],
    /// The same bytes as `value`, when the caller holds them where nobody can change them (a
    /// Python `bytes`): sent as they are. `None`: `value` is copied once before the first
    /// attempt, so that a retry sends what the first attempt sent even if the caller's buffer
    /// changed meanwhile.
    pub shared: Option<Bytes>,
}

/// One object of [`Objects::put_many_shared`]: its key, its bytes and, when the caller holds
/// them immutably, the same bytes to send without a copy (see [`NewRecord::shared`]).
pub type PutItem<'a> = (&'a str, &'a [u8], Option<&'a Bytes>);

/// A random non-zero version for a new object (from the kernel, so two writers of one key never
/// pick the same one, whatever a program does to its own random generators).
pub fn new_version() -> Result<u64, ClientError> {
    let mut raw = [0u8; 8];
    fill_from_kernel(&mut raw)?;
    Ok(u64::from_le_bytes(raw).max(1))
}

/// `count` versions as [`new_version`] picks them, from one `getrandom` call instead of one
/// each (a wide shuffle's mapper puts hundreds of small objects per call).
pub fn new_versions(count: usize) -> Result<Vec<u64>, ClientError> {
    let mut raw = vec![0u8; count * 8];
    fill_from_kernel(&mut raw)?;
    Ok(raw
        .chunks_exact(8)
        .map(|chunk| u64::from_le_bytes(chunk.try_into().expect("8 bytes")).max(1))
        .collect())
}

/// Most `getrandom` calls that one fill makes: requests above 256 bytes may return short (a
/// signal) and a call interrupted before any byte fails with EINTR; both are retried, this
/// many calls in all, and then the fill fails instead of spinning.
pub const GETRANDOM_CALLS_MAX: usize = 32;

/// Fill `raw` with random bytes from the kernel (`getrandom`), in at most
/// [`GETRANDOM_CALLS_MAX`] calls.
fn fill_from_kernel(raw: &mut [u8]) -> Result<(), ClientError> {
    fill_with(raw, |tail| {
        // SAFETY: the pointer and length are those of `tail`, a live mutable slice.
        let got = unsafe { libc::getrandom(tail.as_mut_ptr().cast(), tail.len(), 0) };
        if got < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(got as usize)
        }
    })
}

/// Fill `raw` by calls of `source` on its unfilled tail (each returns how many bytes it wrote
/// there), retrying short and interrupted calls, at most [`GETRANDOM_CALLS_MAX`] calls; an
/// error other than EINTR or EAGAIN fails at once.
fn fill_with(
    raw: &mut [u8],
    mut source: impl FnMut(&mut [u8]) -> std::io::Result<usize>,
) -> Result<(), ClientError> {
    let mut filled = 0;
    let mut last_failure = String::from("short reads");
    for _ in 0..GETRANDOM_CALLS_MAX {
        if filled == raw.len() {
            return Ok(());
        }
        match source(&mut raw[filled..]) {
            Ok(got) => filled += got.min(raw.len() - filled),
            Err(error)
                if matches!(error.raw_os_error(), Some(libc::EINTR) | Some(libc::EAGAIN)) =>
            {
                last_failure = error.to_string();
            }
            Err(error) => {
                return Err(ClientError::Randomness(format!(
                    "getrandom failed after {filled} of {} bytes: {error}",
                    raw.len()
                )))
            }
        }
    }
    if filled == raw.len() {
        return Ok(());
    }
    Err(ClientError::Randomness(format!(
        "getrandom gave {filled} of {} bytes in {GETRANDOM_CALLS_MAX} calls ({last_failure})",
        raw.len()
    )))
}

/// The header of a small object of `size` bytes.
pub fn small_header(version: u64, size: u64, persist: bool) -> ObjectHeader {
    ObjectHeader {
        version,
        size,
        block_count: 0,
        block_size: 0,
        flags: if persist { HEADER_FLAG_PERSIST } else { 0 },
    }
}

/// The manifest header of a large object of `size` bytes in blocks of `block_size`.
pub fn large_header(version: u64, size: u64, block_size: u32, persist: bool) -> ObjectHeader {
    ObjectHeader {
        version,
        size,
        block_count: size.div_ceil(u64::from(block_size)) as u32,
        block_size,
        flags: if persist { HEADER_FLAG_PERSIST } else { 0 },
    }
}

/// Whether `error` is a server's definite refusal (the operation did not happen), as opposed to
/// a failure that leaves the outcome unknown (unreachable, timed out, a protocol break).
pub fn refused(error: &ClientError) -> bool {
    !(error.is_unavailable()
        || matches!(error, ClientError::Protocol(_))
        || error.code() == Code::Internal as i32)
}

pub(crate) fn kind_is(error: &ClientError, kind: &str) -> bool {
    matches!(error, ClientError::Server { message, .. }
        if message.split_once(": ").is_some_and(|(k, _)| k == kind))
}

/// Where the blocks of one upload went: address -> block indexes.
pub type Placed = HashMap<String, BTreeSet<u32>>;

impl Objects {
    // -- records -------------------------------------------------------------------------------

    /// Store block-0 records, pipelined over one session per server, all servers at once;
    /// stale maps are adopted and the refused records sent again, a bucket missing on a server
    /// that joined the job later is created there. A non-overwrite put first claims each key
    /// where write-once needs it (a fence on the arbiter, lookups on the rivals: see
    /// `write_once.rs`) and stores only what it won; an overwrite removes the key's other
    /// versions after storing.
    ///
    /// Every record is tried; the first failure (in the order of `records`) is returned.
    pub fn put_records(
        &self,
        bucket: &str,
        records: &[NewRecord<'_>],
        persist: bool,
        overwrite: bool,
    ) -> Result<(), Failure> {
        let outcomes = self.put_records_each(bucket, records, persist, overwrite);
        match outcomes.into_iter().flatten().next() {
            Some(failure) => Err(failure),
            None => Ok(()),
        }
    }

    /// [`Objects::put_records`], with each record's failure (`None`: stored).
    pub(crate) fn put_records_each(
        &self,
        bucket: &str,
        records: &[NewRecord<'_>],
        persist: bool,
        overwrite: bool,
    ) -> Vec<Option<Failure>> {
        self.put_records_checked(bucket, records, persist, overwrite)
            .unwrap_or_else(|failure| vec![Some(failure); records.len()])
    }

    /// [`Objects::put_records_each`]; a failure to create a missing bucket ends the call.
    fn put_records_checked(
        &self,
        bucket: &str,
        records: &[NewRecord<'_>],
        persist: bool,
        overwrite: bool,
    ) -> Result<Vec<Option<Failure>>, Failure> {
        let flags = (if persist { OP_FLAG_PERSIST } else { 0 })
            | (if overwrite { OP_FLAG_OVERWRITE } else { 0 });
        let mut errors: Vec<Option<Failure>> = vec![None; records.len()];
        // Where each record's fence is (possibly) placed, and whether its record may be stored.
        let mut fenced: Vec<Option<String>> = vec![None; records.len()];
        let mut maybe_stored = vec![false; records.len()];
        let mut repaired: BTreeSet<String> = BTreeSet::new();
        let mut pending: Vec<usize> = (0..records.len()).collect();
        // Each value is read from the caller's memory once: a retry (a stale map, a bucket
        // repaired) sends the bytes the first attempt sent, even if the caller's buffer changed.
        let values: Vec<Bytes> = records
            .iter()
            .map(|record| {
                record
                    .shared
                    .clone()
                    .unwrap_or_else(|| Bytes::copy_from_slice(record.value))
            })
            .collect();
        for attempt in 0..=STALE_EPOCH_RETRIES_MAX {
            let view = self.view();
            let last = attempt == STALE_EPOCH_RETRIES_MAX;
            let mut plans: Vec<(usize, KeyPlan<'_>)> = Vec::with_capacity(pending.len());
            for &index in &pending {
                match plan(&view, records[index].key, persist) {
                    Ok(plan) => plans.push((index, plan)),
                    Err(failure) => errors[index] = Some(failure),
                }
            }
            // A fence placed under an earlier map on another server than this map's arbiter
            // is taken back; the claim places one where this map decides.
            for (index, plan) in &plans {
                let wanted = plan.arbiter.filter(|_| persist && plan.fences());
                if let Some(address) = fenced[*index].take() {
                    if wanted.is_some_and(|a| a.address == address) {
                        fenced[*index] = Some(address);
                    } else {
                        let record = &records[*index];
                        self.remove_fence(
                            &view,
                            bucket,
                            record.key,
                            &address,
                            record.header.version,
                        );
                    }
                }
            }
            let mut retry: Vec<usize> = Vec::new();
            let mut stale: Option<Failure> = None;
            if !overwrite && plans.iter().any(|(_, p)| p.claims(persist)) {
                let claimed = self.claim(&view, bucket, records, &plans, persist, &mut fenced);
                let mut missing: BTreeSet<&str> = BTreeSet::new();
                plans.retain(|(index, plan)| match &claimed[index] {
                    Claimed::Won => true,
                    Claimed::Stale(failure) if !last => {
                        stale = Some(failure.clone());
                        retry.push(*index);
                        false
                    }
                    Claimed::MissingBucket if !last => {
                        missing.insert(plan.arbiter.map_or("", |a| a.address.as_str()));
                        retry.push(*index);
                        false
                    }
                    Claimed::Stale(failure) | Claimed::Failed(failure) => {
                        errors[*index] = Some(failure.clone());
                        false
                    }
                    Claimed::MissingBucket => {
                        errors[*index] = Some(Failure::at(
                            ClientError::Server {
                                code: Code::NotFound as i32,
                                message: format!("bucket_not_found: {bucket}"),
                            },
                            plan.arbiter.map_or("", |a| a.address.as_str()),
                        ));
                        false
                    }
                });
                for address in missing {
                    if repaired.insert(address.to_string()) {
                        self.repair_bucket(&view, bucket, address)?;
                    }
                }
            }
            let stored = self.store_round(
                &view,
                bucket,
                records,
                &values,
                &plans,
                flags,
                last,
                &mut repaired,
                &mut errors,
                &mut retry,
                &mut stale,
            )?;
            for (index, _) in &plans {
                // Sent, and stored or with an unknown outcome: the record may be there. Or
                // refused as existing on the PERSIST home: another writer stored through this
                // put's fence, which now stands for that record.
                maybe_stored[*index] |= errors[*index]
                    .as_ref()
                    .is_some_and(|f| !refused(&f.error) || f.error.is_already_exists());
            }
            for (index, plan, replaced) in &stored {
                maybe_stored[*index] = true;
                if overwrite {
                    let record = &records[*index];
                    self.after_overwrite(&view, bucket, record, plan, *replaced, persist);
                }
            }
            if let Some(stale) = stale {
                if let Err(failure) = self.adopt_or_fail(stale, attempt) {
                    for &index in &retry {
                        errors[index] = Some(failure.clone());
                    }
                    retry.clear();
                }
            }
            pending = retry;
            if pending.is_empty() {
                break;
            }
        }
        // A fence of a put that stored nothing is taken back (one whose record may be stored
        // stays: it is what keeps that record the only one).
        let view = self.view();
        for (index, fence) in fenced.iter().enumerate() {
            if let (Some(address), Some(_)) = (fence, &errors[index]) {
                if !maybe_stored[index] {
                    let record = &records[index];
                    self.remove_fence(&view, bucket, record.key, address, record.header.version);
                }
            }
        }
        Ok(errors)
    }

    /// Store the records of `plans` on their homes, pipelined per server, all servers at once.
    /// Returns each stored record with its plan and the header it replaced; a refused record
    /// gets its error, or joins `retry` (a stale map, noted in `stale`, or a bucket the server
    /// lacked, created there now).
    #[allow(clippy::too_many_arguments)]
    fn store_round<'v>(
        &self,
        view: &'v View,
        bucket: &str,
        records: &[NewRecord<'_>],
        values: &[Bytes],
        plans: &[(usize, KeyPlan<'v>)],
        flags: u8,
        last: bool,
        repaired: &mut BTreeSet<String>,
        errors: &mut [Option<Failure>],
        retry: &mut Vec<usize>,
        stale: &mut Option<Failure>,
    ) -> Result<Vec<(usize, KeyPlan<'v>, Option<ObjectHeader>)>, Failure> {
        let mut groups: Vec<(&Server, Vec<usize>)> = Vec::new();
        for (at, (_, plan)) in plans.iter().enumerate() {
            match groups
                .iter_mut()
                .find(|(s, _)| s.address == plan.home.address)
            {
                Some((_, group)) => group.push(at),
                None => groups.push((plan.home, vec![at])),
            }
        }
        let outcomes = run_parallel(
            &groups.iter().collect::<Vec<_>>(),
            groups.len(),
            |(server, group)| {
                let requests: Vec<ExchangeRequest> = group
                    .iter()
                    .map(|&at| {
                        let index = plans[at].0;
                        ExchangeRequest {
                            op: OpCode::Put,
                            flags,
                            bucket: bucket.to_string(),
                            key: records[index].key.to_string(),
                            header: records[index].header,
                            value: values[index].clone(),
                        }
                    })
                    .collect();
                self.exchange(view, &server.address, &requests)
            },
        );
        let mut stored = Vec::new();
        // Ephemeral puts refused as existing where a fence may stand for a record never stored.
        let mut lost: Vec<(usize, KeyPlan<'v>, &'v Server)> = Vec::new();
        let through_allowed = flags & (OP_FLAG_PERSIST | OP_FLAG_OVERWRITE) == 0;
        for ((server, group), outcome) in groups.iter().zip(outcomes) {
            let replies = match outcome {
                Ok(replies) => replies,
                Err(error) => vec![failure_reply(&error); group.len()],
            };
            let mut missing_bucket: Vec<(usize, ClientError)> = Vec::new();
            for (&at, reply) in group.iter().zip(replies) {
                let (index, plan) = &plans[at];
                if reply.status == 0 {
                    stored.push((*index, plan.clone(), reply.header));
                    continue;
                }
                let error = reply_error(&reply);
                if error.is_stale_epoch() && !last {
                    *stale = Some(Failure::at(error, &server.address));
                    retry.push(*index);
                } else if kind_is(&error, "bucket_not_found")
                    && !repaired.contains(&server.address)
                    && !last
                {
                    missing_bucket.push((*index, error));
                } else if error.is_already_exists() {
                    let target = through_allowed
                        .then(|| through_fence_target(view, records[*index].key, plan))
                        .flatten();
                    match target {
                        Some(target) => lost.push((*index, plan.clone(), target)),
                        None => errors[*index] = Some(held_on(bucket, records[*index].key, server)),
                    }
                } else {
                    errors[*index] = Some(Failure::at(error, &server.address));
                }
            }
            if !missing_bucket.is_empty() {
                repaired.insert(server.address.clone());
                if self.repair_bucket(view, bucket, &server.address)? {
                    retry.extend(missing_bucket.into_iter().map(|(index, _)| index));
                } else {
                    for (index, error) in missing_bucket {
                        errors[index] = Some(Failure::at(error, &server.address));
                    }
                }
            }
        }
        if !lost.is_empty() {
            stored.extend(
                self.store_through_fences(view, bucket, records, values, lost, flags, errors),
            );
        }
        Ok(stored)
    }

    /// Create `bucket` on the server at `address` if another server of the job has it (a server
    /// added to the job after the bucket was created learns of it on the first put that reaches
    /// it). Returns whether it was created; each server is repaired at most once per client.
    pub fn repair_bucket(&self, view: &View, bucket: &str, address: &str) -> Result<bool, Failure> {
        let mark = (address.to_string(), bucket.to_string());
        if self
            .repaired_buckets
            .lock()
            .expect("never poisoned")
            .contains(&mark)
        {
            return Ok(false);
        }
        let probe = EnumerateRequest {
            ctx: view.ctx.clone(),
            bucket: bucket.to_string(),
            prefix: String::new(),
            start_after: None,
            limit: 1,
        };
        let mut seen: BTreeSet<&str> = BTreeSet::from([address]);
        let known = view
            .servers
            .iter()
            .filter(|s| seen.insert(s.address.as_str()))
            .any(|s| {
                self.action(&s.address, ActionName::Enumerate, body(&probe))
                    .is_ok()
            });
        if !known {
            return Ok(false);
        }
        let create = BucketRequest {
            ctx: view.ctx.clone(),
            bucket: bucket.to_string(),
        };
        match self.action(address, ActionName::CreateBucket, body(&create)) {
            Ok(_) => {}
            Err(error) if kind_is(&error, "bucket_exists") => {}
            Err(error) => return Err(Failure::at(error, address)),
        }
        self.repaired_buckets
            .lock()
            .expect("never poisoned")
            .insert(mark);
        Ok(true)
    }

    // -- data blocks ---------------------------------------------------------------------------

    /// Free a version's data blocks (best effort: a failure leaves garbage that the job's end
    /// frees, never an error).
    pub fn delete_blocks(&self, bucket: &str, key: &str, header: &ObjectHeader) {
        let view = self.view();
        let mut groups: Placed = HashMap::new();
        for index in 1..=header.block_count {
            if view.epoch > 1 || header.overflowed() {
                // Blocks may have been placed under an earlier map, or by an overflowing writer
                // that skipped full servers: ask every server.
                for server in &view.servers {
                    groups
                        .entry(server.address.clone())
                        .or_default()
                        .insert(index);
                }
            } else if let Ok(server) = block_home(
                &view,
                key.as_bytes(),
                index,
                header.block_count,
                header.persist(),
                &Skipped::none(),
            ) {
                groups
                    .entry(server.address.clone())
                    .or_default()
                    .insert(index);
            }
        }
        self.delete_block_groups(bucket, key, header.version, &groups);
    }

    /// Free the given blocks of one version, servers in parallel; returns the failures.
    pub fn delete_block_groups(
        &self,
        bucket: &str,
        key: &str,
        version: u64,
        groups: &HashMap<String, BTreeSet<u32>>,
    ) -> Vec<Failure> {
        let work: Vec<(&String, &BTreeSet<u32>)> = groups.iter().collect();
        let outcomes = run_parallel(&work, work.len(), |(address, blocks)| {
            for attempt in 0..=STALE_EPOCH_RETRIES_MAX {
                let view = self.view();
                let request = DeleteBlocksRequest {
                    ctx: view.ctx.clone(),
                    bucket: bucket.to_string(),
                    key: key.to_string(),
                    version,
                    blocks: blocks.iter().copied().collect(),
                };
                match self.action(address, ActionName::DeleteBlocks, body(&request)) {
                    Ok(_) => return Ok(()),
                    Err(error) if error.is_stale_epoch() => {
                        self.adopt_or_fail(Failure::at(error, address), attempt)?;
                    }
                    Err(error) => return Err(Failure::at(error, address)),
                }
            }
            unreachable!("the last attempt returns")
        });
        outcomes.into_iter().filter_map(Result::err).collect()
    }

    /// Write the data blocks of the object of manifest `header` held in memory, cut and placed
    /// as the manifest says (skipping what `overflow` skips): every server's blocks over one
    /// stream, servers in parallel. A server that refuses its blocks as full is skipped from then
    /// on and its blocks go where placement puts them without it; once every block is stored,
    /// blocks stored on a server that a later refusal made skipped are moved where the final
    /// list puts them, so readers find every block at its place. Returns where the blocks went
    /// (also on failure, so the caller can free them).
    fn upload_blocks(
        &self,
        bucket: &str,
        key: &str,
        header: &ObjectHeader,
        data: &[u8],
        overflow: &Overflowing,
    ) -> (Placed, Result<(), Failure>) {
        let placed = std::sync::Mutex::new(Placed::new());
        let upload = BlockUpload {
            objects: self,
            bucket,
            key,
            version: header.version,
            block_size: header.block_size,
            block_count: header.block_count,
            persist: header.persist(),
            placed: &placed,
            overflow,
        };
        let blocks: Vec<BlockSlice<'_>> =
            BlockSlice::cut(data, header.block_size as usize).collect();
        let mut outcome = upload.send_placed(&blocks, self.io_threads);
        // Moves are bounded: each round follows a refusal that skipped one more server.
        let view = self.view();
        for _ in 0..=view.servers.len() {
            if outcome.is_err() || overflow.skipped().is_empty() {
                break;
            }
            let misplaced = upload.misplaced(&placed.lock().expect("never poisoned"));
            let Ok(misplaced) = misplaced else {
                outcome = misplaced.map(|_| ());
                break;
            };
            if misplaced.is_empty() {
                break;
            }
            let moving: Vec<BlockSlice<'_>> = blocks
                .iter()
                .filter(|b| misplaced.values().any(|indexes| indexes.contains(&b.index)))
                .copied()
                .collect();
            {
                let mut placed = placed.lock().expect("never poisoned");
                for (address, indexes) in &misplaced {
                    if let Some(stored) = placed.get_mut(address) {
                        stored.retain(|i| !indexes.contains(i));
                    }
                }
            }
            outcome = upload.send_placed(&moving, self.io_threads);
            self.delete_block_groups(bucket, key, header.version, &misplaced);
        }
        let placed = placed.into_inner().expect("never poisoned");
        (placed, outcome)
    }

    // -- whole objects -------------------------------------------------------------------------

    /// Store `data` under `key`: a small object as its record, a large one as data blocks
    /// striped over the job and then the manifest (the commit point). Write-once unless
    /// `overwrite`. A large object that fails leaves none of its blocks behind, unless its
    /// commit was sent and its outcome is unknown (the record may point at them), or a server
    /// did not answer its blocks (they may land there later; the job's end frees them).
    ///
    /// What a full server refuses goes on to the job's other servers (`overflow.rs`): a small
    /// object whose home is full becomes a manifest there with its one data block elsewhere.
    pub fn put(
        &self,
        bucket: &str,
        key: &str,
        data: &[u8],
        persist: bool,
        overwrite: bool,
    ) -> Result<(), Failure> {
        if data.len() as u64 <= SMALL_OBJECT_MAX_BYTES {
            // Without a server full lately (the usual case) the home is looked up only once,
            // by the write-once plan: each lookup costs a placement hash.
            if !data.is_empty() && self.any_recently_full() {
                let view = self.view();
                let record_home = home(&view, key.as_bytes(), 0, persist)?;
                let full = self.recently_full(&view, key.as_bytes(), 1, persist, [record_home]);
                if !full.is_empty() {
                    return self.put_overflowed(bucket, key, data, persist, overwrite, full);
                }
            }
            let record = NewRecord {
                key,
                header: small_header(
                    new_version().map_err(Failure::local)?,
                    data.len() as u64,
                    persist,
                ),
                value: data,
                shared: None,
            };
            let outcome = self.put_records_each(bucket, &[record], persist, overwrite);
            return match outcome.into_iter().flatten().next() {
                None => Ok(()),
                Some(failure) => self.small_refused(bucket, key, data, persist, overwrite, failure),
            };
        }
        let block_size = self.view().block_size;
        let version = new_version().map_err(Failure::local)?;
        let header = large_header(version, data.len() as u64, block_size, persist);
        self.put_large(bucket, key, header, data, overwrite)
    }

    /// A small object whose record its home refused: when the home is full, the object goes on
    /// as a manifest at its home with its one data block on another server; else the refusal.
    fn small_refused(
        &self,
        bucket: &str,
        key: &str,
        data: &[u8],
        persist: bool,
        overwrite: bool,
        failure: Failure,
    ) -> Result<(), Failure> {
        let view = self.view();
        match self.full_server(&view, &failure) {
            // An empty object has no data to put elsewhere: its record is all there is.
            Some(server) if !data.is_empty() => {
                let overflow = Overflowing::after(server, &failure);
                self.put_overflowed(bucket, key, data, persist, overwrite, overflow)
            }
            _ => Err(failure),
        }
    }

    /// Store `data` (a small object too) as a manifest and data blocks that skip the servers
    /// `overflow` skips (full ones).
    fn put_overflowed(
        &self,
        bucket: &str,
        key: &str,
        data: &[u8],
        persist: bool,
        overwrite: bool,
        overflow: Overflowing,
    ) -> Result<(), Failure> {
        let block_size = self.view().block_size;
        let version = new_version().map_err(Failure::local)?;
        let header = large_header(version, data.len() as u64, block_size, persist);
        self.put_blocks_then_manifest(bucket, key, header, data, overwrite, overflow)
    }

    /// Store a large object of manifest `header` whose bytes are `data`: in one round trip when
    /// every data block lives on block 0's home (always for one data block), else its blocks
    /// and then the manifest. What [`Objects::put`] says of failures holds.
    pub(crate) fn put_large(
        &self,
        bucket: &str,
        key: &str,
        header: ObjectHeader,
        data: &[u8],
        overwrite: bool,
    ) -> Result<(), Failure> {
        let view = self.view();
        // The homes of the manifest and of every block (a placement hash each) are looked up
        // only when a server was full lately.
        let full = if self.any_recently_full() {
            let layout = Layout::placed(header);
            let homes: Vec<&Server> = (0..=header.block_count)
                .filter_map(|block| match block {
                    0 => home(&view, key.as_bytes(), 0, header.persist()).ok(),
                    _ => layout.block_home(&view, key.as_bytes(), block).ok(),
                })
                .collect();
            self.recently_full(
                &view,
                key.as_bytes(),
                header.block_count,
                header.persist(),
                homes,
            )
        } else {
            Overflowing::default()
        };
        if full.is_empty() {
            let record = NewRecord {
                key,
                header,
                value: &[],
                shared: None,
            };
            match self.put_committed(bucket, &record, data, overwrite) {
                None => {}
                Some(Err(failure)) => {
                    // The home refused the one-trip upload as full: the blocks go elsewhere.
                    let Some(server) = self.full_server(&view, &failure) else {
                        return Err(failure);
                    };
                    let overflow = Overflowing::after(server, &failure);
                    return self
                        .put_blocks_then_manifest(bucket, key, header, data, overwrite, overflow);
                }
                Some(Ok(())) => return Ok(()),
            }
        }
        self.put_blocks_then_manifest(bucket, key, header, data, overwrite, full)
    }

    /// The data blocks of a large object (skipping what `overflow` skips, and whatever refuses
    /// them as full), then its manifest, which names what they skipped.
    fn put_blocks_then_manifest(
        &self,
        bucket: &str,
        key: &str,
        header: ObjectHeader,
        data: &[u8],
        overwrite: bool,
        overflow: Overflowing,
    ) -> Result<(), Failure> {
        let (version, persist) = (header.version, header.persist());
        let what = format!("{bucket}/{key} ({} bytes)", header.size);
        let (placed, uploaded) = self.upload_blocks(bucket, key, &header, data, &overflow);
        let value = uploaded.and_then(|()| overflow.manifest_value(&what));
        let (flag, value) = match value {
            Ok(value) => value,
            Err(failure) => {
                self.delete_block_groups(bucket, key, version, &placed);
                return Err(overflow.explain(failure, &what));
            }
        };
        let record = NewRecord {
            key,
            header: ObjectHeader {
                flags: header.flags | flag,
                ..header
            },
            value: &value,
            shared: None,
        };
        self.put_records(bucket, &[record], persist, overwrite)
            .inspect_err(|failure| {
                // The commit was sent. Refused (or withdrawn for a rival), its blocks are freed;
                // with an unknown outcome they are kept: the record may point at them (if not,
                // they stay as garbage until the job ends, which beats an object whose blocks
                // are gone).
                if refused(&failure.error) {
                    self.delete_block_groups(bucket, key, version, &placed);
                }
            })
    }

    /// A large object whose data blocks all live on its block-0 home (one of one data block
    /// always does): one upload that carries every block and then stores the manifest (a
    /// `commit` in the descriptor), one round trip instead of two. The server stores the
    /// manifest only once every block is, and frees the blocks when the upload or the manifest
    /// fails, so nothing is left of a refused put.
    ///
    /// `None` when the blocks live elsewhere, or the server's map was newer or it lacked the
    /// bucket (nothing was stored): the caller then takes the two-step path, which handles those.
    fn put_committed(
        &self,
        bucket: &str,
        record: &NewRecord<'_>,
        data: &[u8],
        overwrite: bool,
    ) -> Option<Result<(), Failure>> {
        let view = self.view();
        let header = record.header;
        let persist = header.persist();
        let key = record.key.as_bytes();
        let server = home(&view, key, 0, persist).ok()?;
        if !overwrite && plan(&view, record.key, persist).ok()?.claims(persist) {
            // Write-once needs its claim before the store: the two-step path makes it.
            return None;
        }
        let layout = Layout::placed(header);
        for index in 1..=header.block_count {
            let block_server = layout.block_home(&view, key, index).ok()?;
            if block_server.address != server.address {
                return None;
            }
        }
        let blocks: Vec<BlockSlice<'_>> =
            BlockSlice::cut(data, header.block_size as usize).collect();
        let descriptor = PutDescriptor {
            ctx: view.ctx.clone(),
            bucket: bucket.to_string(),
            key: record.key.to_string(),
            version: header.version,
            block_size: header.block_size,
            persist,
            commit: Some(PutCommit {
                size: header.size,
                overwrite,
            }),
        };
        let address = server.address.as_str();
        let sent = self
            .connection(address)
            .and_then(|connection| connection.put_blocks_blocking(body(&descriptor), &blocks));
        let result = match sent {
            Ok(result) => result,
            Err(error) if error.is_stale_epoch() => {
                return self
                    .adopt_or_fail(Failure::at(error, address), 0)
                    .err()
                    .map(Err);
            }
            Err(error) if kind_is(&error, "bucket_not_found") => return None,
            // Refused by a record or a fence on the arbiter (the upload freed its blocks): the
            // two-step path tells them apart and stores through a fence.
            Err(error)
                if error.is_already_exists()
                    && !overwrite
                    && !persist
                    && plan(&view, record.key, persist)
                        .ok()
                        .and_then(|plan| through_fence_target(&view, record.key, &plan))
                        .is_some() =>
            {
                return None
            }
            Err(error) => return Some(Err(Failure::at(error, address))),
        };
        let stored: PutStored = match serde_json::from_slice(&result) {
            Ok(stored) => stored,
            Err(e) => {
                let error = ClientError::Protocol(format!("an upload's result: {e}"));
                return Some(Err(Failure::at(error, address)));
            }
        };
        if !stored.committed {
            // A server that does not know commits stored the blocks only: store the manifest.
            return Some(
                self.put_records(bucket, std::slice::from_ref(record), persist, overwrite)
                    .inspect_err(|failure| {
                        if refused(&failure.error) {
                            self.delete_blocks(bucket, record.key, &header);
                        }
                    }),
            );
        }
        if overwrite {
            if let Ok(plan) = plan(&view, record.key, persist) {
                self.after_overwrite(&view, bucket, record, &plan, stored.replaced, persist);
            }
        }
        Some(Ok(()))
    }

    /// Store many objects; returns how many were stored. Small objects go as records,
    /// pipelined over one session per server, in rounds of at most `PUT_MANY_CHUNK_OPS`
    /// objects and `PUT_MANY_CHUNK_BYTES` (one whose home refused it as full, or was full a
    /// moment ago, goes on as [`Objects::put`] sends it); large ones form the last round, at
    /// most `LARGE_OBJECTS_IN_FLIGHT_MAX` at once. A round's first failure (in item order) is
    /// returned once every other object of the round was tried; later rounds are not sent.
    pub fn put_many(
        &self,
        bucket: &str,
        items: &[(&str, &[u8])],
        persist: bool,
        overwrite: bool,
    ) -> Result<usize, Failure> {
        let items: Vec<PutItem<'_>> = items.iter().map(|&(key, data)| (key, data, None)).collect();
        self.put_many_shared(bucket, &items, persist, overwrite)
    }

    /// [`Objects::put_many`] of items that may carry their bytes as shared [`Bytes`] (see
    /// [`NewRecord::shared`]): those small objects are sent without a copy of their own.
    pub fn put_many_shared(
        &self,
        bucket: &str,
        items: &[PutItem<'_>],
        persist: bool,
        overwrite: bool,
    ) -> Result<usize, Failure> {
        let mut large: Vec<(&str, &[u8])> = Vec::new();
        let mut round: Vec<PutItem<'_>> = Vec::new();
        let mut round_bytes = 0usize;
        for &(key, data, shared) in items {
            if data.len() as u64 > SMALL_OBJECT_MAX_BYTES {
                large.push((key, data));
                continue;
            }
            round.push((key, data, shared));
            round_bytes += data.len();
            if round.len() >= PUT_MANY_CHUNK_OPS || round_bytes >= PUT_MANY_CHUNK_BYTES {
                self.put_small_round(bucket, &round, persist, overwrite)?;
                round.clear();
                round_bytes = 0;
            }
        }
        if !round.is_empty() {
            self.put_small_round(bucket, &round, persist, overwrite)?;
        }
        let at_once = LARGE_OBJECTS_IN_FLIGHT_MAX.min(self.io_threads).max(1);
        let outcomes = run_parallel(&large, at_once, |(key, data)| {
            self.put(bucket, key, data, persist, overwrite)
        });
        match outcomes.into_iter().find_map(Result::err) {
            Some(failure) => Err(failure),
            None => Ok(items.len()),
        }
    }

    /// One round of small objects of [`Objects::put_many`]: records pipelined per server, then
    /// the ones whose home is full one by one as [`Objects::put`] stores them; the first
    /// failure in item order.
    fn put_small_round(
        &self,
        bucket: &str,
        items: &[PutItem<'_>],
        persist: bool,
        overwrite: bool,
    ) -> Result<(), Failure> {
        let view = self.view();
        let mut outcomes: Vec<Option<Result<(), Failure>>> = vec![None; items.len()];
        let mut records: Vec<(usize, NewRecord<'_>)> = Vec::new();
        // Without a server full lately (the usual case) no key's home is looked up here: each
        // costs a placement hash, and `put_records_each` finds the homes (and any error) anyway.
        let any_full = self.any_recently_full();
        let mut versions = new_versions(items.len())
            .map_err(Failure::local)?
            .into_iter();
        for (index, &(key, data, shared)) in items.iter().enumerate() {
            let version = versions.next().expect("one version per item");
            if any_full && !data.is_empty() {
                let full = match home(&view, key.as_bytes(), 0, persist) {
                    Ok(server) => self.recently_full(&view, key.as_bytes(), 1, persist, [server]),
                    Err(failure) => {
                        outcomes[index] = Some(Err(failure));
                        continue;
                    }
                };
                if !full.is_empty() {
                    outcomes[index] =
                        Some(self.put_overflowed(bucket, key, data, persist, overwrite, full));
                    continue;
                }
            }
            let header = small_header(version, data.len() as u64, persist);
            records.push((
                index,
                NewRecord {
                    key,
                    header,
                    value: data,
                    shared: shared.cloned(),
                },
            ));
        }
        let batch: Vec<NewRecord<'_>> = records.iter().map(|(_, r)| r.clone()).collect();
        let stored = self.put_records_each(bucket, &batch, persist, overwrite);
        for ((index, record), failure) in records.iter().zip(stored) {
            outcomes[*index] = Some(match failure {
                None => Ok(()),
                Some(failure) => self.small_refused(
                    bucket,
                    record.key,
                    record.value,
                    persist,
                    overwrite,
                    failure,
                ),
            });
        }
        match outcomes.into_iter().flatten().find_map(Result::err) {
            Some(failure) => Err(failure),
            None => Ok(()),
        }
    }
}

/// One object version's block upload, shared by its per-server streams.
pub(crate) struct BlockUpload<'a> {
    pub(crate) objects: &'a Objects,
    pub(crate) bucket: &'a str,
    pub(crate) key: &'a str,
    pub(crate) version: u64,
    pub(crate) block_size: u32,
    /// The object's data blocks, or any count above one for a streamed upload of more than one
    /// that does not know its count yet (placement tells only one block from more).
    pub(crate) block_count: u32,
    pub(crate) persist: bool,
    pub(crate) placed: &'a std::sync::Mutex<Placed>,
    /// The servers the blocks skip, because they refused as full.
    pub(crate) overflow: &'a Overflowing,
}

impl BlockUpload<'_> {
    /// The home of data block `index` under the current map and what the upload skips.
    pub(crate) fn block_home<'v>(&self, view: &'v View, index: u32) -> Result<&'v Server, Failure> {
        block_home(
            view,
            self.key.as_bytes(),
            index,
            self.block_count,
            self.persist,
            &self.overflow.skipped(),
        )
    }

    /// Send `blocks` where they belong, one stream per server, up to `threads` servers at once;
    /// the first failure, a full tier's first.
    fn send_placed(&self, blocks: &[BlockSlice<'_>], threads: usize) -> Result<(), Failure> {
        let view = self.objects.view();
        let mut groups: Vec<(&str, Vec<BlockSlice<'_>>)> = Vec::new();
        for block in blocks {
            let server = self.block_home(&view, block.index)?;
            push_grouped(&mut groups, &server.address, *block);
        }
        let outcomes = run_parallel(
            &groups.iter().collect::<Vec<_>>(),
            threads,
            |(address, blocks)| self.send(address, blocks, STALE_EPOCH_RETRIES_MAX),
        );
        let failures: Vec<Failure> = outcomes.into_iter().filter_map(Result::err).collect();
        // A full tier is what the caller can act on: report it over follow-on failures.
        let first = failures
            .iter()
            .find(|f| kind_is(&f.error, "capacity_exhausted"))
            .or(failures.first())
            .cloned();
        first.map_or(Ok(()), Err)
    }

    /// The stored blocks (`placed`) not where the upload's current list of skipped servers puts
    /// them: address -> block indexes.
    fn misplaced(&self, placed: &Placed) -> Result<Placed, Failure> {
        let view = self.objects.view();
        let mut misplaced = Placed::new();
        for (address, indexes) in placed {
            for &index in indexes {
                if self.block_home(&view, index)?.address != *address {
                    misplaced.entry(address.clone()).or_default().insert(index);
                }
            }
        }
        Ok(misplaced)
    }

    /// Send `blocks` to `address`; after a stale map, send them again where the new map puts
    /// them; a bucket the server lacks is created there once; a server that refuses them as
    /// full, or does not answer within the op timeout, is skipped from then on, and they go
    /// where placement puts them without it.
    pub(crate) fn send(
        &self,
        address: &str,
        blocks: &[BlockSlice<'_>],
        attempts_left: usize,
    ) -> Result<(), Failure> {
        self.placed
            .lock()
            .expect("never poisoned")
            .entry(address.to_string())
            .or_default()
            .extend(blocks.iter().map(|b| b.index));
        let mut repaired = false;
        loop {
            let view = self.objects.view();
            let descriptor = PutDescriptor {
                ctx: view.ctx.clone(),
                bucket: self.bucket.to_string(),
                key: self.key.to_string(),
                version: self.version,
                block_size: self.block_size,
                persist: self.persist,
                commit: None,
            };
            let connection = self
                .objects
                .connection(address)
                .map_err(|e| Failure::at(e, address))?;
            match connection.put_blocks_blocking(body(&descriptor), blocks) {
                Ok(_) => return Ok(()),
                Err(error) if error.is_stale_epoch() => {
                    if attempts_left == 0 {
                        return Err(Failure::at(error, address));
                    }
                    self.objects.adopt_or_fail(Failure::at(error, address), 0)?;
                    return self.send_replaced(blocks, attempts_left - 1);
                }
                Err(error) if kind_is(&error, "bucket_not_found") && !repaired => {
                    if !self.objects.repair_bucket(&view, self.bucket, address)? {
                        return Err(Failure::at(error, address));
                    }
                    repaired = true;
                }
                Err(error) => {
                    let failure = Failure::at(error, address);
                    let skipped = match self.objects.full_server(&view, &failure) {
                        Some(full) => full,
                        // A server that did not answer within the op timeout (hung, or gone):
                        // its blocks go on to the job's other servers as a full server's do,
                        // so the write ends within its bound instead of failing on it.
                        None if failure.error.is_unavailable() => {
                            match view.servers.iter().find(|s| s.address == address) {
                                Some(silent) => silent,
                                None => return Err(failure),
                            }
                        }
                        None => return Err(failure),
                    };
                    // A full server freed what it took of the stream: nothing of it is there. A
                    // silent one may still store it when it runs again; those blocks are not
                    // counted as placed, since freeing them now would only wait on it: no
                    // manifest names them, and the job's end frees them.
                    if let Some(stored) =
                        self.placed.lock().expect("never poisoned").get_mut(address)
                    {
                        for block in blocks {
                            stored.remove(&block.index);
                        }
                    }
                    // Each refusal skips one more server, which bounds the recursion.
                    self.overflow.skip(skipped, &failure);
                    return self.send_replaced(blocks, attempts_left);
                }
            }
        }
    }

    /// Send blocks again where the current map and list of skipped servers place them.
    fn send_replaced(
        &self,
        blocks: &[BlockSlice<'_>],
        attempts_left: usize,
    ) -> Result<(), Failure> {
        let view = self.objects.view();
        let mut groups: Vec<(&str, Vec<BlockSlice<'_>>)> = Vec::new();
        for block in blocks {
            let server = self.block_home(&view, block.index)?;
            push_grouped(&mut groups, &server.address, *block);
        }
        for (address, group) in &groups {
            self.send(address, group, attempts_left)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_of_one_call_are_non_zero_and_distinct() {
        // 4096 versions are 32 KiB of one getrandom call, above the 256 bytes it always
        // returns whole: a short read is filled up, not left as zeros.
        for count in [0, 1, 33, 4096] {
            let versions = new_versions(count).unwrap();
            assert_eq!(versions.len(), count);
            assert!(versions.iter().all(|&v| v != 0));
            let distinct: BTreeSet<u64> = versions.iter().copied().collect();
            assert_eq!(distinct.len(), count);
        }
    }

    #[test]
    fn fills_take_short_and_interrupted_reads_within_their_bound() {
        // Short reads and EINTR are retried until the buffer is full.
        let mut raw = [0u8; 40];
        let mut calls = 0;
        fill_with(&mut raw, |tail| {
            calls += 1;
            if calls % 2 == 0 {
                return Err(std::io::Error::from_raw_os_error(libc::EINTR));
            }
            let n = tail.len().min(8);
            tail[..n].fill(7);
            Ok(n)
        })
        .unwrap();
        assert_eq!(raw, [7u8; 40]);
        assert_eq!(calls, 9);
    }

    #[test]
    fn fills_that_never_finish_fail_typed_after_their_bound() {
        // A source that always returns short (one byte of many) or keeps being interrupted
        // fails after GETRANDOM_CALLS_MAX calls instead of spinning.
        for interrupted in [false, true] {
            let mut raw = vec![0u8; 4 * GETRANDOM_CALLS_MAX];
            let mut calls = 0;
            let error = fill_with(&mut raw, |tail| {
                calls += 1;
                if interrupted {
                    return Err(std::io::Error::from_raw_os_error(libc::EINTR));
                }
                tail[0] = 1;
                Ok(1)
            })
            .unwrap_err();
            assert_eq!(calls, GETRANDOM_CALLS_MAX);
            assert!(matches!(error, ClientError::Randomness(_)), "{error:?}");
            assert!(error.to_string().starts_with("internal: "), "{error}");
            assert_eq!(error.code(), tonic::Code::Internal as i32);
        }
        // Any other failure ends the fill at once.
        let mut calls = 0;
        let error = fill_with(&mut [0u8; 8], |_| {
            calls += 1;
            Err(std::io::Error::from_raw_os_error(libc::ENOSYS))
        })
        .unwrap_err();
        assert_eq!(calls, 1);
        assert!(
            error
                .to_string()
                .contains("getrandom failed after 0 of 8 bytes"),
            "{error}"
        );
    }
}
