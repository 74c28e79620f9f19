//! Write-once per key, with exactly one winner among concurrent writers, and overwrites that
//! replace every version of a key.
//!
//! One server decides each key: its *arbiter*, the key's ephemeral home under the map in use.
//! An ephemeral put stores its record there, so the store itself is its claim (the server's
//! write-once per record decides between two writers). A PERSIST put whose PERSIST home is
//! another server first places a *fence* on the arbiter: a record of no bytes with
//! `HEADER_FLAG_FENCE` and the put's version, stored write-once like any record, so a fence and
//! an ephemeral record of one key exclude each other on that one server, and only then stores
//! its record on the PERSIST home. Whatever the timing, the first of them to reach the arbiter
//! wins and every other writer gets `already_exists`; nobody withdraws a stored record.
//!
//! Once the job's map changed (epoch > 1), a key may also be held where an earlier map put it,
//! so a put first looks for it on the servers that can hold it (its *rivals*: the servers of the
//! map that an earlier map placed its block 0 on, ephemeral or PERSIST, from the map's
//! `earlier`; every other server of the map when the map does not say; and a suspect only for
//! keys an earlier map, or the map with the suspect's held weight given back, places on it) and
//! stores nothing if one does. A key no earlier map placed anywhere but its home and arbiter
//! pays no round trip for this. A rival check that needs a suspect server (a
//! hung one, listed in the map's `suspects`) is refused at once with a typed error instead of
//! waiting on it; keys whose checks do not need it are written as usual.
//!
//! A fence stands for a record on the key's PERSIST home, which may never come: its put may
//! have failed with an unknown outcome (a store that timed out can still land later, so the
//! fence stays). So an ephemeral put that finds a fence on the arbiter stores *through* it: its
//! record goes to the PERSIST home, write-once there, where the fenced record would go. Exactly
//! one of them lands (the PERSIST home's write-once decides), readers find it through the fence,
//! and the loser gets `already_exists`; a PERSIST put whose store is refused as existing keeps
//! its fence, which now stands for the record stored through it. Only where the PERSIST home is
//! the one place an earlier map can have put the key besides the arbiter (under a changed map
//! the fenced put may have aimed elsewhere), and never on a suspect; otherwise the put gets
//! `already_exists` as before. A PERSIST put whose fence is refused by another writer's fence
//! goes on to its store the same way (the PERSIST home is its own home).
//!
//! Readers read through fences (a fence is "not here": the record is on the PERSIST home), and
//! a read with DELETE that takes a fence takes the PERSIST record after it. An overwrite replaces
//! what the arbiter holds (record or fence) and removes the other versions: an ephemeral
//! overwrite of a fenced key deletes the PERSIST record the fence stood for, a PERSIST overwrite
//! fences the arbiter over the ephemeral record, and after a map change the rivals' versions go.

use std::collections::{BTreeSet, HashMap};

use bytes::Bytes;
use pocketflow_protocol::action::{ActionName, ObjectRequest};
use pocketflow_protocol::frame::{OpCode, OP_FLAG_OVERWRITE};
use pocketflow_protocol::header::{ObjectHeader, HEADER_FLAG_FENCE};
use tonic::Code;

use crate::connection::{ExchangeReply, ExchangeRequest};
use crate::error::ClientError;
use crate::failure::{body, failure_reply, reply_error, server_error, Failure};
use crate::homes::home;
use crate::objects::Objects;
use crate::parallel::run_parallel;
use crate::view::{Server, View};
use crate::writes::{kind_is, NewRecord};

/// Where one key's put is decided under one view.
#[derive(Debug, Clone)]
pub(crate) struct KeyPlan<'v> {
    /// Where its record goes (the PERSIST home for a PERSIST put).
    pub(crate) home: &'v Server,
    /// The server that decides between writers (its ephemeral home); `None` when the map places
    /// no ephemeral record (then no ephemeral writer can race a PERSIST one).
    pub(crate) arbiter: Option<&'v Server>,
    /// The other servers an earlier map may have put the key on.
    pub(crate) rivals: Vec<&'v Server>,
}

impl KeyPlan<'_> {
    /// Whether a PERSIST put of this key has to fence its arbiter.
    pub(crate) fn fences(&self) -> bool {
        self.arbiter
            .is_some_and(|arbiter| arbiter.node_id != self.home.node_id)
    }

    /// Whether a non-overwrite put of this key takes a round trip before its store.
    pub(crate) fn claims(&self, persist: bool) -> bool {
        (persist && self.fences()) || !self.rivals.is_empty()
    }
}

/// The fence header of a PERSIST put of `version`.
pub(crate) fn fence_header(version: u64) -> ObjectHeader {
    ObjectHeader {
        version,
        flags: HEADER_FLAG_FENCE,
        ..ObjectHeader::default()
    }
}

/// The typed refusal of a put whose rival check needs a suspect server.
fn suspect_failure(view: &View, suspect: &Server, key: &str) -> Failure {
    let error = server_error(
        Code::Unavailable as i32,
        "suspect_server",
        format!(
            "{key} may be held on {}, which does not answer (a suspect of epoch {}); \
             its write-once check waits for it to answer again",
            suspect.node_id, view.epoch
        ),
    );
    Failure::at(error, &suspect.address)
}

/// The `already_exists` answer of a put that found `key` held on `holder`.
pub(crate) fn held_on(bucket: &str, key: &str, holder: &Server) -> Failure {
    Failure::at(
        ClientError::Server {
            code: Code::AlreadyExists as i32,
            message: format!(
                "already_exists: {bucket}/{key} is held on {}",
                holder.node_id
            ),
        },
        &holder.address,
    )
}

/// Record `verdict` for record `index` if it outweighs what is there: a loss or failure
/// outweighs a retry, a retry outweighs a win.
fn outweigh(outcomes: &mut HashMap<usize, Claimed>, index: usize, verdict: Claimed) {
    let rank = |c: &Claimed| match c {
        Claimed::Won => 0,
        Claimed::MissingBucket => 1,
        Claimed::Stale(_) => 2,
        Claimed::Failed(_) => 3,
    };
    let slot = outcomes.get_mut(&index).expect("every plan has an outcome");
    if rank(&verdict) > rank(slot) {
        *slot = verdict;
    }
}

/// Where a put of `key` is decided under `view` (see the module doc). With `overwrite` the
/// rivals are the servers whose versions the overwrite removes.
pub(crate) fn plan<'v>(view: &'v View, key: &str, persist: bool) -> Result<KeyPlan<'v>, Failure> {
    let raw = key.as_bytes();
    let home = home(view, raw, 0, persist)?;
    // An ephemeral put's arbiter is its home: one placement hash, not two.
    let arbiter = if persist {
        view.server_for(raw, 0, false)
    } else {
        Some(home)
    };
    let mut rivals = Vec::new();
    if view.epoch > 1 {
        let mut seen: BTreeSet<&str> = BTreeSet::from([home.node_id.as_str()]);
        if let Some(arbiter) = arbiter {
            seen.insert(arbiter.node_id.as_str());
        }
        // (server, whether an earlier map placed the key on it)
        let candidates: Vec<(&Server, bool)> = match view.earlier_homes(raw) {
            Some(homes) => homes
                .into_iter()
                .map(|i| (&view.servers[i], true))
                .chain(
                    view.servers
                        .iter()
                        .filter(|s| view.is_suspect(&s.node_id))
                        .map(|s| (s, false)),
                )
                .collect(),
            None => view.servers.iter().map(|s| (s, false)).collect(),
        };
        for (server, placed_before) in candidates {
            if !seen.insert(server.node_id.as_str()) {
                continue;
            }
            if view.is_suspect(&server.node_id) {
                if placed_before || view.suspect_may_hold(raw, &server.node_id) {
                    return Err(suspect_failure(view, server, key));
                }
                continue;
            }
            rivals.push(server);
        }
    }
    Ok(KeyPlan {
        home,
        arbiter,
        rivals,
    })
}

/// What the claim round of one record came to.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Claimed {
    /// Go on and store it.
    Won,
    /// Run it again under the newer map a server answered with.
    Stale(Failure),
    /// The arbiter lacks the bucket (it joined the job later): create it there, then again.
    MissingBucket,
    /// Lost, or failed: store nothing.
    Failed(Failure),
}

impl Objects {
    /// The claim round of non-overwrite puts: fence the arbiter of each PERSIST record that
    /// needs it and look for each key on its rivals, pipelined per server, all servers at once.
    /// `fenced[i]` names the arbiter that holds record `i`'s fence (set here, also when the
    /// outcome is unknown, so that a later cleanup removes it).
    pub(crate) fn claim(
        &self,
        view: &View,
        bucket: &str,
        records: &[NewRecord<'_>],
        plans: &[(usize, KeyPlan<'_>)],
        persist: bool,
        fenced: &mut [Option<String>],
    ) -> HashMap<usize, Claimed> {
        // Per server: (record index, whether it is a fence) in request order.
        let mut groups: Vec<(&Server, Vec<(usize, bool)>)> = Vec::new();
        let mut push = |server: &'_ Server, item: (usize, bool)| match groups
            .iter_mut()
            .find(|(s, _)| s.address == server.address)
        {
            Some((_, group)) => group.push(item),
            None => groups.push((server_ref(view, server), vec![item])),
        };
        for (index, plan) in plans {
            if persist && plan.fences() {
                let arbiter = plan.arbiter.expect("a fencing plan has an arbiter");
                if fenced[*index].as_deref() != Some(arbiter.address.as_str()) {
                    push(arbiter, (*index, true));
                }
            }
            for rival in &plan.rivals {
                push(rival, (*index, false));
            }
        }
        let mut outcomes: HashMap<usize, Claimed> =
            plans.iter().map(|(i, _)| (*i, Claimed::Won)).collect();
        if groups.is_empty() {
            return outcomes;
        }
        // Records whose PERSIST put may go on to its store past another writer's fence.
        let through: HashMap<usize, &Server> = plans
            .iter()
            .filter(|(_, plan)| plan.rivals.is_empty() && !view.is_suspect(&plan.home.node_id))
            .filter_map(|(index, plan)| Some((*index, plan.arbiter?)))
            .collect();
        // (record index, arbiter) of fences refused as existing, to look at below.
        let mut refused_fences: Vec<(usize, &Server)> = Vec::new();
        let replies = run_parallel(
            &groups.iter().collect::<Vec<_>>(),
            groups.len(),
            |(server, group)| {
                let requests: Vec<ExchangeRequest> = group
                    .iter()
                    .map(|&(index, fence)| ExchangeRequest {
                        op: if fence { OpCode::Put } else { OpCode::Lookup },
                        flags: 0,
                        bucket: bucket.to_string(),
                        key: records[index].key.to_string(),
                        header: if fence {
                            fence_header(records[index].header.version)
                        } else {
                            ObjectHeader::default()
                        },
                        value: Bytes::new(),
                    })
                    .collect();
                self.exchange(view, &server.address, &requests)
            },
        );
        for ((server, group), outcome) in groups.iter().zip(replies) {
            let replies = match outcome {
                Ok(replies) => replies,
                Err(error) => vec![failure_reply(&error); group.len()],
            };
            for (&(index, fence), reply) in group.iter().zip(replies) {
                let verdict = if reply.status == 0 {
                    if fence {
                        fenced[index] = Some(server.address.clone());
                        continue;
                    }
                    Claimed::Failed(held_on(bucket, records[index].key, server))
                } else {
                    let error = reply_error(&reply);
                    if error.is_stale_epoch() {
                        Claimed::Stale(Failure::at(error, &server.address))
                    } else if kind_is(&error, "bucket_not_found") && fence {
                        Claimed::MissingBucket
                    } else if fence && error.is_already_exists() {
                        if persist {
                            if let Some(arbiter) = through.get(&index) {
                                refused_fences.push((index, arbiter));
                                continue;
                            }
                        }
                        Claimed::Failed(held_on(bucket, records[index].key, server))
                    } else if !fence && error.is_not_found() {
                        continue;
                    } else {
                        if fence {
                            // The fence may have been placed: the cleanup removes our version.
                            fenced[index] = Some(server.address.clone());
                        }
                        Claimed::Failed(Failure::at(error, &server.address))
                    }
                };
                outweigh(&mut outcomes, index, verdict);
            }
        }
        // A fence of another writer is where its PERSIST record would go, this put's home: the
        // put goes on to its store there, which decides (see the module doc). A record there is
        // the key's.
        let fences: Vec<bool> = self.pipelined(
            view,
            refused_fences.iter().map(|(index, arbiter)| {
                let lookup = ExchangeRequest {
                    op: OpCode::Lookup,
                    flags: 0,
                    bucket: bucket.to_string(),
                    key: records[*index].key.to_string(),
                    header: ObjectHeader::default(),
                    value: Bytes::new(),
                };
                (*arbiter, lookup)
            }),
            |_, reply| reply.status == 0 && reply.header.is_some_and(|h| h.fence()),
        );
        for ((index, arbiter), fence) in refused_fences.into_iter().zip(fences) {
            if !fence {
                let lost = Claimed::Failed(held_on(bucket, records[index].key, arbiter));
                outweigh(&mut outcomes, index, lost);
            }
        }
        outcomes
    }

    /// Take back the fence of `version` on `address` (a put that lost or failed before its
    /// record was stored); a fence already gone, or replaced by an overwrite, is fine.
    pub(crate) fn remove_fence(
        &self,
        view: &View,
        bucket: &str,
        key: &str,
        address: &str,
        version: u64,
    ) {
        let request = ObjectRequest {
            ctx: view.ctx.clone(),
            bucket: bucket.to_string(),
            key: key.to_string(),
            version: Some(version),
        };
        // Left behind, a fence of no record is harmless to readers (they read through it), and
        // the job's end frees it.
        let _ = self.action(address, ActionName::Delete, body(&request));
    }

    /// After an overwrite stored `record` on `plan.home` (replacing `replaced` there): free the
    /// replaced version's blocks and remove every other version of the key (see the module doc).
    /// Best effort: a version that cannot be removed now is freed with the job.
    pub(crate) fn after_overwrite(
        &self,
        view: &View,
        bucket: &str,
        record: &NewRecord<'_>,
        plan: &KeyPlan<'_>,
        replaced: Option<ObjectHeader>,
        persist: bool,
    ) {
        let (key, version) = (record.key, record.header.version);
        let mut others: Vec<&Server> = Vec::new();
        match replaced {
            // An ephemeral overwrite of a fenced key: the PERSIST record it stood for goes.
            Some(fence) if fence.fence() => {
                if let Some(persist_home) = view.server_for(key.as_bytes(), 0, true) {
                    if persist_home.node_id != plan.home.node_id {
                        others.push(persist_home);
                    }
                }
            }
            Some(replaced) if replaced.block_count > 0 => {
                self.delete_blocks(bucket, key, &replaced);
            }
            _ => {}
        }
        if persist && plan.fences() {
            let arbiter = plan.arbiter.expect("a fencing plan has an arbiter");
            let request = ExchangeRequest {
                op: OpCode::Put,
                flags: OP_FLAG_OVERWRITE,
                bucket: bucket.to_string(),
                key: key.to_string(),
                header: fence_header(version),
                value: Bytes::new(),
            };
            match self.exchange(view, &arbiter.address, std::slice::from_ref(&request)) {
                Ok(mut replies) => {
                    let reply = replies.pop().expect("one reply per request");
                    if let Some(header) = reply
                        .header
                        .filter(|h| reply.status == 0 && !h.fence() && h.block_count > 0)
                    {
                        self.delete_blocks(bucket, key, &header);
                    }
                }
                // The ephemeral version stays in front of the new one; deleting it is the
                // next best thing.
                Err(_) => others.push(arbiter),
            }
        }
        others.extend(plan.rivals.iter().copied());
        self.delete_everywhere(view, bucket, key, &others);
    }

    /// DELETE `key` on each of `servers` (all at once) and free the data blocks of what they
    /// held; best effort.
    fn delete_everywhere(&self, view: &View, bucket: &str, key: &str, servers: &[&Server]) {
        if servers.is_empty() {
            return;
        }
        let request = ExchangeRequest {
            op: OpCode::Delete,
            flags: 0,
            bucket: bucket.to_string(),
            key: key.to_string(),
            header: ObjectHeader::default(),
            value: Bytes::new(),
        };
        let deleted = run_parallel(servers, servers.len(), |server| {
            self.exchange(view, &server.address, std::slice::from_ref(&request))
                .ok()
                .and_then(|mut replies| replies.pop())
                .filter(|reply| reply.status == 0)
                .and_then(|reply| reply.header)
        });
        for header in deleted.into_iter().flatten() {
            if !header.fence() && header.block_count > 0 {
                self.delete_blocks(bucket, key, &header);
            }
        }
    }
}

/// The server an ephemeral put of `key` stores through a fence on, when the rule allows it (see
/// the module doc): the PERSIST home, if it is another server than the arbiter, not a suspect,
/// and the only server besides the arbiter that an earlier map may have put the key on.
pub(crate) fn through_fence_target<'v>(
    view: &'v View,
    key: &str,
    plan: &KeyPlan<'v>,
) -> Option<&'v Server> {
    let persist_home = view.server_for(key.as_bytes(), 0, true)?;
    let alone = plan
        .rivals
        .iter()
        .all(|rival| rival.node_id == persist_home.node_id);
    (persist_home.node_id != plan.home.node_id && !view.is_suspect(&persist_home.node_id) && alone)
        .then_some(persist_home)
}

impl Objects {
    /// Ephemeral puts refused as existing on their arbiter (`lost`: record index, its plan and
    /// the server it will store through, from [`through_fence_target`]): those whose arbiter
    /// holds a fence are stored through it, write-once on the PERSIST home. Returns the stored
    /// ones with the header each replaced (none); every other one gets its error in `errors`
    /// (`already_exists` where the key is held, as before).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn store_through_fences<'v>(
        &self,
        view: &'v View,
        bucket: &str,
        records: &[NewRecord<'_>],
        values: &[Bytes],
        lost: Vec<(usize, KeyPlan<'v>, &'v Server)>,
        flags: u8,
        errors: &mut [Option<Failure>],
    ) -> Vec<(usize, KeyPlan<'v>, Option<ObjectHeader>)> {
        let request = |index: usize, op: OpCode| ExchangeRequest {
            op,
            flags: if op == OpCode::Put { flags } else { 0 },
            bucket: bucket.to_string(),
            key: records[index].key.to_string(),
            header: if op == OpCode::Put {
                records[index].header
            } else {
                ObjectHeader::default()
            },
            value: if op == OpCode::Put {
                values[index].clone()
            } else {
                Bytes::new()
            },
        };
        // Round 1: what each arbiter holds.
        let fenced: Vec<bool> = self.pipelined(
            view,
            lost.iter()
                .map(|(index, plan, _)| (plan.home, request(*index, OpCode::Lookup))),
            |_, reply| reply.status == 0 && reply.header.is_some_and(|h| h.fence()),
        );
        let mut through = Vec::new();
        for ((index, plan, target), fence) in lost.into_iter().zip(fenced) {
            if fence {
                through.push((index, plan, target));
            } else {
                errors[index] = Some(held_on(bucket, records[index].key, plan.home));
            }
        }
        // Round 2: the records, write-once on the PERSIST homes.
        let outcomes: Vec<Option<ClientError>> = self.pipelined(
            view,
            through
                .iter()
                .map(|(index, _, target)| (*target, request(*index, OpCode::Put))),
            |_, reply| (reply.status != 0).then(|| reply_error(reply)),
        );
        let mut stored = Vec::new();
        for ((index, plan, target), outcome) in through.into_iter().zip(outcomes) {
            match outcome {
                None => stored.push((index, plan, None)),
                Some(error) if error.is_already_exists() => {
                    errors[index] = Some(held_on(bucket, records[index].key, target));
                }
                Some(error) => errors[index] = Some(Failure::at(error, &target.address)),
            }
        }
        stored
    }

    /// Run one request per item on its server, pipelined per server, all servers at once; maps
    /// each reply (a failed exchange's error as a reply) with `judge`, in item order.
    fn pipelined<'v, T: Send>(
        &self,
        view: &'v View,
        items: impl Iterator<Item = (&'v Server, ExchangeRequest)>,
        judge: impl Fn(&Server, &ExchangeReply) -> T + Sync,
    ) -> Vec<T> {
        let mut groups: Vec<(&Server, Vec<(usize, ExchangeRequest)>)> = Vec::new();
        let mut count = 0;
        for (server, request) in items {
            match groups.iter_mut().find(|(s, _)| s.address == server.address) {
                Some((_, group)) => group.push((count, request)),
                None => groups.push((server, vec![(count, request)])),
            }
            count += 1;
        }
        let answers = run_parallel(
            &groups.iter().collect::<Vec<_>>(),
            groups.len(),
            |(server, group)| {
                let requests: Vec<ExchangeRequest> =
                    group.iter().map(|(_, request)| request.clone()).collect();
                let replies = match self.exchange(view, &server.address, &requests) {
                    Ok(replies) => replies,
                    Err(error) => vec![failure_reply(&error); group.len()],
                };
                group
                    .iter()
                    .zip(replies)
                    .map(|((at, _), reply)| (*at, judge(server, &reply)))
                    .collect::<Vec<_>>()
            },
        );
        let mut slots: Vec<Option<T>> = std::iter::repeat_with(|| None).take(count).collect();
        for (at, judged) in answers.into_iter().flatten() {
            slots[at] = Some(judged);
        }
        slots
            .into_iter()
            .map(|slot| slot.expect("every item has a reply"))
            .collect()
    }
}

/// `server` as a reference into `view` (plans hold references into the view already; this
/// keeps the borrow checker's view of the groups simple).
fn server_ref<'v>(view: &'v View, server: &Server) -> &'v Server {
    view.servers
        .iter()
        .find(|s| s.node_id == server.node_id)
        .expect("a planned server is a server of the view")
}
