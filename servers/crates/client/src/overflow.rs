//! Data bigger than a job's first tier: where a write goes when a server is full, and the
//! client's short memory of full servers.
//!
//! The rule (docs/ARCHITECTURE.md, "Bigger than DRAM"): a data write that a server refuses as
//! full (`capacity_exhausted`, or `draining`) is placed again without that server, as
//! `homes::block_home` places an overflowed object's blocks: a block's next server in its
//! ranking, on the job's next tier once a whole tier is full. Block 0 never moves: the object's
//! manifest stays at its home, which keeps a reserve of its tier for such records, flagged
//! `HEADER_FLAG_OVERFLOW` and naming the skipped servers, so readers, waiters, DELETE claims,
//! listings and notifications find every key where they always did, and only an overflowed
//! object pays for the list (one JSON value read with its record). A small object refused at
//! its home becomes such a manifest with one data block. `CapacityExhausted` comes only when
//! no server of the job can take a block, or the home cannot take even the manifest.
//!
//! A write that learns a server is full remembers it for `FULL_SERVER_MEMO_MS`, so the writes
//! after it skip that server at once instead of each sending its bytes to be refused first.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;

use tonic::Code;

use crate::error::ClientError;
use crate::failure::{server_error, Failure};
use crate::homes::{block_home, Skipped};
use crate::objects::Objects;
use crate::placement::SERVERS_MAX;
use crate::view::{Server, View};
use crate::writes::kind_is;

/// How long a client skips a server after it refused a write as full; then the next write
/// that the server's placement asks for tries it again (DELETE reads may have freed it).
pub const FULL_SERVER_MEMO_MS: u64 = 1_000;

/// The servers that refused a write as full lately: node id -> when. At most `SERVERS_MAX`
/// entries; expired ones are dropped on every insert.
#[derive(Debug, Default)]
pub(crate) struct FullServers {
    /// Node id -> when it refused, and what it said.
    seen: HashMap<String, (Instant, String)>,
}

impl FullServers {
    fn note(&mut self, node_id: &str, message: String, now: Instant) {
        let memo = Duration::from_millis(FULL_SERVER_MEMO_MS);
        self.seen
            .retain(|_, (at, _)| now.duration_since(*at) < memo);
        if self.seen.len() < SERVERS_MAX || self.seen.contains_key(node_id) {
            self.seen.insert(node_id.to_string(), (now, message));
        }
    }

    /// Whether any server refused within the memo.
    fn any(&self, now: Instant) -> bool {
        let memo = Duration::from_millis(FULL_SERVER_MEMO_MS);
        self.seen
            .values()
            .any(|(at, _)| now.duration_since(*at) < memo)
    }

    /// What `node_id` said when it refused, if that was within the memo.
    fn refusal(&self, node_id: &str, now: Instant) -> Option<&str> {
        self.seen
            .get(node_id)
            .filter(|(at, _)| now.duration_since(*at) < Duration::from_millis(FULL_SERVER_MEMO_MS))
            .map(|(_, message)| message.as_str())
    }
}

/// Whether `failure` is a server refusing a write for want of room (it is full, or draining):
/// what makes a write go on to the job's other servers.
pub(crate) fn refused_as_full(failure: &Failure) -> bool {
    !failure.server.is_empty()
        && (kind_is(&failure.error, "capacity_exhausted") || kind_is(&failure.error, "draining"))
}

/// The error of a write that found no server with room: every refusal it met, server by server.
/// When every one of them was a draining server's, the write is refused as draining (the job's
/// servers are leaving, not full), as a write to one of them is. When any server did not answer
/// (hung, or gone: it is skipped like a full one so a write ends within its bound), the write is
/// `unavailable`, not `capacity_exhausted`: that server may well have room, and a job whose
/// servers are all gone must read as gone.
pub(crate) fn no_room(what: &str, refusals: &[(String, String)]) -> Failure {
    let said: Vec<String> = refusals
        .iter()
        .map(|(node_id, message)| format!("{node_id}: {message}"))
        .collect();
    if refusals
        .iter()
        .any(|(_, message)| message.starts_with("unavailable: "))
    {
        return Failure::local(ClientError::Unavailable(format!(
            "no server of the job could take {what}: some did not answer, the others had no \
             room: {}",
            said.join("; ")
        )));
    }
    let draining = !refusals.is_empty()
        && refusals
            .iter()
            .all(|(_, message)| message.starts_with("draining: "));
    if draining {
        return Failure::local(server_error(
            Code::Unavailable as i32,
            "draining",
            format!(
                "every server of the job that could take {what} is draining: {}",
                said.join("; ")
            ),
        ));
    }
    Failure::local(server_error(
        Code::ResourceExhausted as i32,
        "capacity_exhausted",
        format!(
            "no server of the job has room for {what}; the job's servers refused it: {}",
            said.join("; ")
        ),
    ))
}

/// What an upload has learnt of full servers: the ones its blocks skip from now on, and each
/// one's refusal (node id, message), for the error that ends a write no server has room for.
#[derive(Debug, Default)]
pub(crate) struct Overflowing {
    skipped: std::sync::Mutex<Skipped>,
    refusals: std::sync::Mutex<Vec<(String, String)>>,
}

impl Overflowing {
    /// An upload that starts by skipping `server`, which refused the write (`failure`).
    pub(crate) fn after(server: &Server, failure: &Failure) -> Overflowing {
        let overflow = Overflowing::default();
        overflow.skip(server, failure);
        overflow
    }

    /// Whether nothing is skipped.
    pub(crate) fn is_empty(&self) -> bool {
        self.skipped.lock().expect("never poisoned").is_empty()
    }

    /// The servers skipped so far.
    pub(crate) fn skipped(&self) -> Skipped {
        self.skipped.lock().expect("never poisoned").clone()
    }

    /// Skip `server` from now on; `failure` is why.
    pub(crate) fn skip(&self, server: &Server, failure: &Failure) {
        self.skip_for(server, failure.error.to_string());
    }

    fn skip_for(&self, server: &Server, message: String) {
        let mut skipped = self.skipped.lock().expect("never poisoned");
        if !skipped.contains(&server.node_id) {
            *skipped = skipped.with(&server.node_id);
            self.refusals
                .lock()
                .expect("never poisoned")
                .push((server.node_id.clone(), message));
        }
    }

    /// `failure` as the caller should see it: a placement that ran out of servers becomes the
    /// list of every refusal met.
    pub(crate) fn explain(&self, failure: Failure, what: &str) -> Failure {
        let refusals = self.refusals.lock().expect("never poisoned");
        if failure.server.is_empty()
            && kind_is(&failure.error, "capacity_exhausted")
            && !refusals.is_empty()
        {
            return no_room(what, &refusals);
        }
        failure
    }

    /// The manifest's header flag and value for what was skipped (none, empty: a plain
    /// manifest); a failure when the list does not fit a manifest.
    pub(crate) fn manifest_value(&self, what: &str) -> Result<(u32, Bytes), Failure> {
        match self.skipped().encode() {
            Some((value, flag)) => Ok((flag, value)),
            None => Err(no_room(
                what,
                &self.refusals.lock().expect("never poisoned"),
            )),
        }
    }
}

impl Objects {
    /// The server of `view` that `failure` names, when it refused a write as full; it is
    /// remembered as full for `FULL_SERVER_MEMO_MS`.
    pub(crate) fn full_server<'v>(&self, view: &'v View, failure: &Failure) -> Option<&'v Server> {
        if !refused_as_full(failure) {
            return None;
        }
        let server = view.servers.iter().find(|s| s.address == failure.server)?;
        self.full_servers.lock().expect("never poisoned").note(
            &server.node_id,
            failure.error.to_string(),
            Instant::now(),
        );
        Some(server)
    }

    /// Whether any server refused a write as full within `FULL_SERVER_MEMO_MS`: when none did
    /// (the usual case), a small put skips the lookup of its home that
    /// [`Objects::recently_full`] needs, which costs a placement hash.
    pub(crate) fn any_recently_full(&self) -> bool {
        let full = self.full_servers.lock().expect("never poisoned");
        // No clock read while nothing was ever full.
        !full.seen.is_empty() && full.any(Instant::now())
    }

    /// The servers among `homes` that refused a write as full within `FULL_SERVER_MEMO_MS`,
    /// as an upload that skips them (with what they said), for a write of an object of
    /// `block_count` data blocks (any count above one for a streamed upload) at `key`; one
    /// that skips none when skipping them would leave the write no server, since what is
    /// remembered may have been freed meanwhile: the write then asks them again.
    pub(crate) fn recently_full<'v>(
        &self,
        view: &View,
        key: &[u8],
        block_count: u32,
        persist: bool,
        homes: impl IntoIterator<Item = &'v Server>,
    ) -> Overflowing {
        let overflow = Overflowing::default();
        {
            let full = self.full_servers.lock().expect("never poisoned");
            if full.seen.is_empty() {
                return overflow;
            }
            let now = Instant::now();
            for server in homes {
                if let Some(message) = full.refusal(&server.node_id, now) {
                    overflow.skip_for(server, message.to_string());
                }
            }
        }
        let skipped = overflow.skipped();
        if skipped.is_empty() || block_home(view, key, 1, block_count, persist, &skipped).is_err() {
            return Overflowing::default();
        }
        overflow
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_servers_are_remembered_for_a_while_and_bounded() {
        let mut full = FullServers::default();
        let start = Instant::now();
        assert!(!full.any(start), "nothing refused yet");
        full.note("dram-0", "tier is full".into(), start);
        assert!(full.any(start));
        assert_eq!(full.refusal("dram-0", start), Some("tier is full"));
        assert_eq!(full.refusal("dram-1", start), None);
        let later = start + Duration::from_millis(FULL_SERVER_MEMO_MS);
        assert_eq!(
            full.refusal("dram-0", later),
            None,
            "forgotten after the memo"
        );
        assert!(
            !full.any(later),
            "an expired entry makes no put look up its home"
        );
        for i in 0..SERVERS_MAX + 10 {
            full.note(&format!("s{i}"), String::new(), start);
        }
        assert!(full.seen.len() <= SERVERS_MAX);
        full.note("s0", String::new(), later);
        assert_eq!(full.seen.len(), 1, "expired entries go on the next insert");
    }

    #[test]
    fn only_a_servers_refusal_for_room_counts_as_full() {
        let full = Failure::at(
            server_error(8, "capacity_exhausted", "tier is full".into()),
            "127.0.0.1:1",
        );
        assert!(refused_as_full(&full));
        let draining = Failure::at(server_error(14, "draining", "x".into()), "127.0.0.1:1");
        assert!(refused_as_full(&draining));
        let local = Failure::local(server_error(8, "capacity_exhausted", "x".into()));
        assert!(!refused_as_full(&local));
        let other = Failure::at(server_error(5, "not_found", "x".into()), "127.0.0.1:1");
        assert!(!refused_as_full(&other));
        let message = no_room(
            "b/k (5 bytes)",
            &[("dram-0".into(), "capacity_exhausted: tier is full".into())],
        );
        assert!(message
            .error
            .to_string()
            .contains("dram-0: capacity_exhausted: tier is full"));
        let leaving = no_room(
            "b/k (5 bytes)",
            &[(
                "dram-0".into(),
                "draining: server dram-0 is draining".into(),
            )],
        );
        assert!(kind_is(&leaving.error, "draining"), "{leaving:?}");
        assert!(!leaving.error.is_unavailable());
        // A server that did not answer may have room: the write is unavailable, not full.
        let silent = no_room(
            "b/k (5 bytes)",
            &[
                ("dram-0".into(), "capacity_exhausted: tier is full".into()),
                (
                    "nvme-0".into(),
                    "unavailable: cannot connect to 127.0.0.1:1".into(),
                ),
            ],
        );
        assert!(silent.error.is_unavailable(), "{silent:?}");
        assert!(!silent.error.is_capacity_exhausted());
        assert!(silent
            .error
            .to_string()
            .contains("nvme-0: unavailable: cannot connect"));
    }
}
