//! Weighted rendezvous hashing: which server of a job's weight map holds block `i` of key `k`.
//!
//! The same function as `pocketflow/placement.py`, bit for bit: `(key, block)` is hashed once
//! (BLAKE2b, 8 bytes, the block index appended as 4 little-endian bytes); each server has a
//! 64-bit seed (BLAKE2b of its node id, personalization `pf-seed`); a pair's score on a server
//! is `-weight / ln(u)` with `u` in (0, 1) from a SplitMix64 mix of the hash and the seed; the
//! highest score wins. `tests/vectors/placement.json` (at the repository root) holds cases both
//! test suites check.
//!
//! A map may route key prefixes to named pools of its servers ([`Routes`]): a block of a key
//! under a routed prefix goes to the rendezvous pick, with equal weights, over the pool's servers.
//!
//! Data block `i` of a large object is placed as `(key, i)`, which stripes the object over the
//! job, except in an object of one data block: that block is placed as `(key, 0)`, with its
//! manifest ([`placed_block`]), so such an object is written and read on one server.
//!
//! The data blocks of an *overflowed* object (its manifest names servers that were full when it
//! was written) are placed without those servers ([`Placement::server_skipping`]): the same
//! pick over the same pool with them left out, so a block whose server was not skipped stays
//! where the map puts it, and the others go to the next server in their ranking, on the job's
//! next tier when a whole tier is skipped.

use std::collections::{BTreeMap, HashMap, HashSet};

use blake2::digest::consts::U8;
use blake2::digest::{Mac, Update};
use blake2::{Blake2b, Blake2bMac, Digest};
use pocketflow_protocol::limits::KEY_MAX_BYTES;

use crate::error::ClientError;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
const MIX_1: u64 = 0xBF58_476D_1CE4_E5B9;
const MIX_2: u64 = 0x94D0_49BB_1331_11EB;
const TWO_POW_MINUS_53: f64 = 1.0 / (1u64 << 53) as f64;
/// Weight given to weight-0 servers when ranking every server for fallback reads.
const RANK_WEIGHT_OF_ZERO: f64 = 1e-9;
/// Most servers one weight map may list (and one pool may name): far more than any job gets,
/// small enough that a map from a server's `stale_epoch` answer cannot make the client build
/// something huge.
pub const SERVERS_MAX: usize = 4096;
/// Most pools one weight map may name.
pub const POOLS_MAX: usize = 16;
/// Most prefix routes one weight map may hold.
pub const ROUTES_MAX: usize = 4096;
/// Longest pool name in bytes (names are `[a-z0-9_-]`).
pub const POOL_NAME_MAX_BYTES: usize = 32;

/// 64-bit hash of `(key, block index)`.
pub fn hash_block(key: &[u8], block: u32) -> u64 {
    let mut hasher = Blake2b::<U8>::new();
    Digest::update(&mut hasher, key);
    Digest::update(&mut hasher, block.to_le_bytes());
    u64::from_le_bytes(hasher.finalize().into())
}

/// The block index that placement hashes for data block `block` (>= 1) of an object of
/// `block_count` data blocks: 0 (its manifest's placement) when the object has one data block,
/// so that the block lives with its manifest; `block` itself when it has more, which stripes them.
/// A writer that knows only that an object has more than one block may pass any count above one.
pub fn placed_block(block: u32, block_count: u32) -> u32 {
    if block_count == 1 {
        0
    } else {
        block
    }
}

/// 64-bit seed of a server, from its node id.
pub fn server_seed(node_id: &str) -> u64 {
    let mut mac = Blake2bMac::<U8>::new_with_salt_and_personal(None, b"", b"pf-seed")
        .expect("an 8-byte output and a 7-byte personalization are valid");
    Update::update(&mut mac, node_id.as_bytes());
    u64::from_le_bytes(mac.finalize().into_bytes().into())
}

fn mix(h: u64, seed: u64) -> u64 {
    let mut z = (h ^ seed).wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(MIX_1);
    z = (z ^ (z >> 27)).wrapping_mul(MIX_2);
    z ^ (z >> 31)
}

fn score(h: u64, seed: u64, weight: f64) -> f64 {
    let unit = ((mix(h, seed) >> 11) as f64 + 0.5) * TWO_POW_MINUS_53;
    -weight / unit.ln()
}

/// One server of a weight map, as placement sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacedServer {
    /// The server's node id (its seed comes from it).
    pub node_id: String,
    /// Its weight; 0 takes no new data.
    pub weight: f64,
    /// Whether it is long-running (takes PERSIST objects).
    pub persist: bool,
}

/// The prefix routes of a weight map, within their bounds: named pools of node ids, and key
/// prefixes each routed to one pool. Empty (the default) when the map has none.
#[derive(Debug, Clone, Default)]
pub struct Routes {
    /// Each pool's member node ids, pools in name order (routes index into it).
    pools: Vec<Vec<String>>,
    /// Each route's prefix with the index of its pool.
    prefixes: HashMap<Box<[u8]>, usize>,
    /// Length of the longest prefix: a `/` further into a key cannot end a routed prefix.
    prefix_bytes_max: usize,
}

fn malformed(why: impl std::fmt::Display) -> ClientError {
    ClientError::InvalidArgument(format!("malformed weight map: {why}"))
}

/// At most the first 64 characters of `text`, for an error message.
fn clipped(text: &str) -> &str {
    text.char_indices()
        .nth(64)
        .map_or(text, |(end, _)| &text[..end])
}

fn check_pool(name: &str, members: &[String]) -> Result<(), ClientError> {
    let name_ok = (1..=POOL_NAME_MAX_BYTES).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    if !name_ok {
        return Err(malformed(format!(
            "pool name {:?} is not 1..={POOL_NAME_MAX_BYTES} bytes of [a-z0-9_-]",
            clipped(name)
        )));
    }
    if members.len() > SERVERS_MAX {
        return Err(malformed(format!(
            "pool {name} has more than {SERVERS_MAX} members"
        )));
    }
    let mut seen = HashSet::with_capacity(members.len());
    if let Some(twice) = members.iter().find(|m| !seen.insert(m.as_str())) {
        return Err(malformed(format!(
            "pool {name} names {:?} twice",
            clipped(twice)
        )));
    }
    Ok(())
}

fn check_prefix(prefix: &str) -> Result<(), ClientError> {
    if prefix.is_empty()
        || prefix.len() >= KEY_MAX_BYTES
        || prefix.starts_with('/')
        || prefix.ends_with('/')
        || prefix.contains("//")
    {
        return Err(malformed(format!(
            "route prefix {:?} ({} bytes) must be shorter than {KEY_MAX_BYTES} bytes, \
             non-empty, without a leading or trailing '/' or a '//'",
            clipped(prefix),
            prefix.len()
        )));
    }
    Ok(())
}

impl Routes {
    /// Routes from a weight map's `"pools"` (name -> member node ids) and `"routes"` (prefix ->
    /// pool name). A member that is no server of the map is not an error: placement ignores it.
    pub fn new(
        pools: BTreeMap<String, Vec<String>>,
        routes: BTreeMap<String, String>,
    ) -> Result<Routes, ClientError> {
        if pools.len() > POOLS_MAX {
            return Err(malformed(format!("more than {POOLS_MAX} pools")));
        }
        if routes.len() > ROUTES_MAX {
            return Err(malformed(format!("more than {ROUTES_MAX} routes")));
        }
        let mut index_of: HashMap<String, usize> = HashMap::with_capacity(pools.len());
        let mut members = Vec::with_capacity(pools.len());
        for (index, (name, ids)) in pools.into_iter().enumerate() {
            check_pool(&name, &ids)?;
            index_of.insert(name, index);
            members.push(ids);
        }
        let mut prefixes = HashMap::with_capacity(routes.len());
        let mut prefix_bytes_max = 0;
        for (prefix, pool) in routes {
            check_prefix(&prefix)?;
            let &index = index_of.get(&pool).ok_or_else(|| {
                malformed(format!(
                    "route {:?} names pool {:?}, which the map does not have",
                    clipped(&prefix),
                    clipped(&pool)
                ))
            })?;
            prefix_bytes_max = prefix_bytes_max.max(prefix.len());
            prefixes.insert(prefix.into_bytes().into_boxed_slice(), index);
        }
        Ok(Routes {
            pools: members,
            prefixes,
            prefix_bytes_max,
        })
    }

    /// Whether no prefix is routed (pools alone route nothing).
    pub fn is_empty(&self) -> bool {
        self.prefixes.is_empty()
    }

    /// Rows these routes hold (pool members and routes), for a bound on maps that carry many.
    pub fn rows(&self) -> usize {
        self.pools.iter().map(Vec::len).sum::<usize>() + self.prefixes.len()
    }

    /// The pool (its index, pools in name order) of the longest route prefix `P` that `key`
    /// lies under, i.e. `key` starts with `P` followed by `/`; `None` when no route matches.
    fn pool_of(&self, key: &[u8]) -> Option<usize> {
        // Candidate prefixes end at a '/' of the key, longest first; keys are short.
        let mut end = key.len().min(self.prefix_bytes_max + 1);
        while let Some(slash) = key[..end].iter().rposition(|&b| b == b'/') {
            if let Some(&index) = self.prefixes.get(&key[..slash]) {
                return Some(index);
            }
            end = slash;
        }
        None
    }
}

#[derive(Debug, Clone)]
struct Pool {
    /// Indexes into the map's servers, with seeds and weights.
    members: Vec<(usize, u64, f64)>,
    uniform: bool,
}

impl Pool {
    fn new(members: Vec<(usize, u64, f64)>) -> Option<Pool> {
        if members.is_empty() {
            return None;
        }
        let first = members[0].2;
        let uniform = members.iter().all(|m| m.2 == first);
        Some(Pool { members, uniform })
    }

    fn pick(&self, h: u64) -> usize {
        self.pick_skipping(h, &[])
            .expect("a pool has at least one member")
    }

    /// [`Pool::pick`] among the members whose index is not in `skipped`; `None` when every
    /// member is.
    fn pick_skipping(&self, h: u64, skipped: &[usize]) -> Option<usize> {
        let mut best = None;
        let members = self
            .members
            .iter()
            .filter(|(index, _, _)| !skipped.contains(index));
        if self.uniform {
            // Equal weights: the largest mixed value wins, no logarithm needed.
            let mut best_mix = 0u64;
            for &(index, seed, _) in members {
                let z = mix(h, seed);
                if best.is_none() || z > best_mix {
                    best_mix = z;
                    best = Some(index);
                }
            }
        } else {
            let mut best_score = f64::NEG_INFINITY;
            for &(index, seed, weight) in members {
                let s = score(h, seed, weight);
                if best.is_none() || s > best_score {
                    best_score = s;
                    best = Some(index);
                }
            }
        }
        best
    }
}

/// Placement over one weight map: build once per epoch; immutable.
#[derive(Debug, Clone)]
pub struct Placement {
    ephemeral: Option<Pool>,
    persist: Option<Pool>,
    all: Vec<(usize, u64, f64)>,
    /// Whether each server of the map (by index) is long-running.
    long_running: Vec<bool>,
    routes: Routes,
    /// Per pool of `routes`: its members in the map, weighted equally; `None` when none is.
    routed: Vec<Option<Pool>>,
}

impl Placement {
    /// Placement over `servers` (in weight-map order; results are indexes into it), no routes.
    pub fn new(servers: &[PlacedServer]) -> Placement {
        Placement::with_routes(servers, Routes::default())
    }

    /// Placement over `servers` with the map's prefix `routes`.
    pub fn with_routes(servers: &[PlacedServer], routes: Routes) -> Placement {
        let seeded: Vec<(usize, u64, &PlacedServer)> = servers
            .iter()
            .enumerate()
            .map(|(i, s)| (i, server_seed(&s.node_id), s))
            .collect();
        let active = |s: &PlacedServer| s.weight > 0.0;
        let ephemeral = Pool::new(
            seeded
                .iter()
                .filter(|(_, _, s)| active(s))
                .map(|&(i, seed, s)| (i, seed, s.weight))
                .collect(),
        );
        let persist_active: Vec<_> = seeded
            .iter()
            .filter(|(_, _, s)| active(s) && s.persist)
            .map(|&(i, seed, s)| (i, seed, s.weight))
            .collect();
        let persist = if persist_active.is_empty() {
            // Long-running servers that get no new ephemeral data still take PERSIST objects.
            Pool::new(
                seeded
                    .iter()
                    .filter(|(_, _, s)| s.persist)
                    .map(|&(i, seed, _)| (i, seed, 1.0))
                    .collect(),
            )
        } else {
            Pool::new(persist_active)
        };
        let all = seeded
            .iter()
            .map(|&(i, seed, s)| {
                let weight = if s.weight > 0.0 {
                    s.weight
                } else {
                    RANK_WEIGHT_OF_ZERO
                };
                (i, seed, weight)
            })
            .collect();
        let routed = routed_pools(servers, &routes);
        Placement {
            ephemeral,
            persist,
            all,
            long_running: servers.iter().map(|s| s.persist).collect(),
            routes,
            routed,
        }
    }

    /// The index of the server that holds block `block` of `key`; `None` when no server can
    /// (no server with weight > 0, or none long-running for `persist`). A key under a routed
    /// prefix goes to the route's pool, unless `persist` or none of the pool is in the map.
    pub fn server_for(&self, key: &[u8], block: u32, persist: bool) -> Option<usize> {
        let pool = if persist {
            self.persist.as_ref()
        } else {
            self.routed_pool(key).or(self.ephemeral.as_ref())
        };
        pool.map(|p| p.pick(hash_block(key, block)))
    }

    /// The index of the server for block `block` of `key` when the servers `skipped` (indexes
    /// into the map) cannot take it: the pick of [`Placement::server_for`]'s pool (PERSIST: the
    /// long-running servers') without them, with the same weights, so a block whose server is
    /// not skipped stays where `server_for` puts it. When that pool has nothing left, the pick
    /// with equal weights over the rest of the map's servers (PERSIST: of its long-running
    /// ones), weight-0 servers included; `None` when nothing is left. Routes play no part: an
    /// object overflowing its route's pool goes on to the job's other servers.
    pub fn server_skipping(
        &self,
        key: &[u8],
        block: u32,
        persist: bool,
        skipped: &[usize],
    ) -> Option<usize> {
        let h = hash_block(key, block);
        let pool = if persist {
            self.persist.as_ref()
        } else {
            self.ephemeral.as_ref()
        };
        if let Some(index) = pool.and_then(|p| p.pick_skipping(h, skipped)) {
            return Some(index);
        }
        self.all
            .iter()
            .filter(|&&(index, _, _)| {
                !skipped.contains(&index) && (!persist || self.long_running[index])
            })
            .max_by_key(|&&(_, seed, _)| mix(h, seed))
            .map(|&(index, _, _)| index)
    }

    /// The pool of the longest route `key` lies under, if that pool has a server in the map.
    fn routed_pool(&self, key: &[u8]) -> Option<&Pool> {
        if self.routes.is_empty() {
            return None;
        }
        self.routed[self.routes.pool_of(key)?].as_ref()
    }

    /// Every server of the map, best-scoring first (the order fallback reads probe in); routes
    /// play no part.
    pub fn ranked(&self, key: &[u8], block: u32) -> Vec<usize> {
        let h = hash_block(key, block);
        let mut scored: Vec<(f64, usize)> = self
            .all
            .iter()
            .map(|&(i, seed, weight)| (score(h, seed, weight), i))
            .collect();
        // Highest score first; equal scores by higher index first, as Python's reverse sort.
        scored.sort_by(|a, b| b.partial_cmp(a).expect("scores are finite"));
        scored.into_iter().map(|(_, i)| i).collect()
    }

    /// Whether PERSIST objects can be placed at all.
    pub fn has_persist(&self) -> bool {
        self.persist.is_some()
    }
}

/// One pool per pool of `routes`: its members that are servers of the map, in the map's order,
/// each with weight 1 whatever its weight in the map.
fn routed_pools(servers: &[PlacedServer], routes: &Routes) -> Vec<Option<Pool>> {
    if routes.is_empty() {
        return Vec::new();
    }
    let mut index_of: HashMap<&str, usize> = HashMap::with_capacity(servers.len());
    for (index, server) in servers.iter().enumerate() {
        index_of.entry(server.node_id.as_str()).or_insert(index);
    }
    let pool = |members: &Vec<String>| {
        let mut present: Vec<usize> = members
            .iter()
            .filter_map(|id| index_of.get(id.as_str()).copied())
            .collect();
        present.sort_unstable();
        Pool::new(
            present
                .into_iter()
                .map(|i| (i, server_seed(&servers[i].node_id), 1.0))
                .collect(),
        )
    };
    routes.pools.iter().map(pool).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_match_the_python_reference() {
        // Values printed by pocketflow.placement.hash_block / server_seed.
        assert_eq!(hash_block(b"key", 0), 8374613497865291850);
        assert_eq!(hash_block(b"", 3), 17092158568922056999);
        assert_eq!(server_seed("dram-0"), 3190597002816539229);
    }

    fn servers(rows: &[(&str, f64, bool)]) -> Vec<PlacedServer> {
        rows.iter()
            .map(|&(node_id, weight, persist)| PlacedServer {
                node_id: node_id.to_string(),
                weight,
                persist,
            })
            .collect()
    }

    fn routes(pools: &[(&str, &[&str])], routes: &[(&str, &str)]) -> Result<Routes, ClientError> {
        Routes::new(
            pools
                .iter()
                .map(|(name, ids)| {
                    (
                        name.to_string(),
                        ids.iter().map(|s| s.to_string()).collect(),
                    )
                })
                .collect(),
            routes
                .iter()
                .map(|(prefix, pool)| (prefix.to_string(), pool.to_string()))
                .collect(),
        )
    }

    const TIERS: [(&str, &[&str]); 2] = [("dram", &["d0", "d1"]), ("nvme", &["n0", "n1"])];

    #[test]
    fn one_data_block_is_placed_with_its_manifest_and_more_are_striped() {
        assert_eq!(placed_block(1, 1), 0);
        for count in [2, 3, 64, u32::MAX] {
            assert_eq!(placed_block(1, count), 1);
            assert_eq!(placed_block(2, count), 2);
        }
    }

    #[test]
    fn equal_weights_pick_as_scoring_with_weight_one() {
        let seeds: Vec<(usize, u64, f64)> = ["a", "b", "c", "d", "e"]
            .iter()
            .enumerate()
            .map(|(i, id)| (i, server_seed(id), 1.0))
            .collect();
        let pool = Pool::new(seeds.clone()).unwrap();
        assert!(pool.uniform);
        for n in 0..2000u32 {
            let h = hash_block(format!("key-{n}").as_bytes(), n % 5);
            let scored = seeds
                .iter()
                .max_by(|a, b| score(h, a.1, 1.0).total_cmp(&score(h, b.1, 1.0)))
                .unwrap()
                .0;
            assert_eq!(pool.pick(h), scored, "key-{n}");
        }
    }

    #[test]
    fn the_longest_matching_prefix_routes_a_key() {
        let r = routes(
            &TIERS,
            &[("r1", "nvme"), ("r1/hot", "dram"), ("a/b", "nvme")],
        )
        .unwrap();
        let (dram, nvme) = (Some(0), Some(1));
        for (key, pool) in [
            ("r1/x", nvme),
            ("r1/", nvme),
            ("r1/hot/x", dram),
            ("r1/hot", nvme),
            ("r1/hotter/x", nvme),
            ("r1", None),
            ("r10/x", None),
            ("x/r1/y", None),
            ("/r1/x", None),
            ("a/b/c", nvme),
            ("a/b/c/d", nvme),
            ("a/bc/d", None),
            ("a/c", None),
            ("", None),
        ] {
            assert_eq!(r.pool_of(key.as_bytes()), pool, "{key:?}");
        }
        assert!(Routes::default().is_empty());
        assert!(routes(&TIERS, &[]).unwrap().is_empty());
    }

    #[test]
    fn malformed_routes_are_refused() {
        let long_name = "p".repeat(POOL_NAME_MAX_BYTES + 1);
        let too_long = "k".repeat(KEY_MAX_BYTES);
        let longest = "k".repeat(KEY_MAX_BYTES - 1);
        assert!(routes(
            &[(&long_name[1..], &["d0"])],
            &[(&longest, &long_name[1..])]
        )
        .is_ok());
        let bad_pools: [&[(&str, &[&str])]; 5] = [
            &[("", &["d0"])],
            &[(&long_name, &["d0"])],
            &[("Dram", &["d0"])],
            &[("dr.am", &["d0"])],
            &[("dram", &["d0", "d1", "d0"])],
        ];
        for pools in bad_pools {
            let error = routes(pools, &[]).unwrap_err();
            assert!(
                error.to_string().contains("malformed weight map"),
                "{error}"
            );
        }
        for prefix in ["", "/a", "a/", "a//b", "/", too_long.as_str()] {
            assert!(routes(&TIERS, &[(prefix, "dram")]).is_err(), "{prefix:?}");
        }
        let error = routes(&TIERS, &[("r1", "ssd")]).unwrap_err();
        assert!(matches!(error, ClientError::InvalidArgument(_)));
        assert!(error.to_string().contains("ssd"), "{error}");
    }

    #[test]
    fn routes_are_bounded() {
        let names: Vec<String> = (0..=POOLS_MAX).map(|i| format!("p{i}")).collect();
        let pools: Vec<(&str, &[&str])> = names.iter().map(|n| (n.as_str(), &[][..])).collect();
        assert!(routes(&pools[..POOLS_MAX], &[]).is_ok());
        assert!(routes(&pools, &[]).is_err());
        let ids: Vec<String> = (0..=SERVERS_MAX).map(|i| format!("s{i}")).collect();
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        assert!(routes(&[("big", &ids[..SERVERS_MAX])], &[]).is_ok());
        assert!(routes(&[("big", &ids)], &[]).is_err());
        let prefixes: Vec<String> = (0..=ROUTES_MAX).map(|i| format!("r{i}")).collect();
        let many: Vec<(&str, &str)> = prefixes.iter().map(|p| (p.as_str(), "dram")).collect();
        assert!(routes(&TIERS, &many[..ROUTES_MAX]).is_ok());
        assert!(routes(&TIERS, &many).is_err());
    }

    #[test]
    fn a_routed_key_goes_to_its_pool_with_equal_weights() {
        let map = servers(&[
            ("d0", 1.0, true),
            ("d1", 3.0, false),
            ("n0", 0.0, false),
            ("n1", 0.0, false),
        ]);
        let r = routes(&TIERS, &[("r1", "nvme"), ("r1/hot", "dram")]).unwrap();
        let routed = Placement::with_routes(&map, r);
        let plain = Placement::new(&map);
        let dram = Pool::new(vec![
            (0, server_seed("d0"), 1.0),
            (1, server_seed("d1"), 1.0),
        ]);
        let mut seen = [0usize; 4];
        for n in 0..400u32 {
            let block = n % 3;
            let key = format!("r1/hot/{n}");
            let h = hash_block(key.as_bytes(), block);
            let got = routed.server_for(key.as_bytes(), block, false).unwrap();
            assert_eq!(got, dram.as_ref().unwrap().pick(h), "{key} block {block}");
            seen[got] += 1;
            let key = format!("r1/{n}");
            let got = routed.server_for(key.as_bytes(), block, false).unwrap();
            assert!(got >= 2, "weight-0 pool members still take routed keys");
            seen[got] += 1;
            let key = format!("other/{n}");
            let got = routed.server_for(key.as_bytes(), block, false);
            assert_eq!(got, plain.server_for(key.as_bytes(), block, false));
            // PERSIST placement and the fallback ranking ignore routes.
            let key = format!("r1/{n}");
            let got = routed.server_for(key.as_bytes(), block, true);
            assert_eq!(got, plain.server_for(key.as_bytes(), block, true));
            assert_eq!(
                routed.ranked(key.as_bytes(), block),
                plain.ranked(key.as_bytes(), block)
            );
        }
        assert!(seen.iter().all(|&count| count > 100), "{seen:?}");
    }

    #[test]
    fn skipping_servers_moves_only_the_blocks_they_held() {
        let map = servers(&[
            ("d0", 0.2, true),
            ("d1", 0.3, true),
            ("n0", 0.5, false),
            ("n1", 0.0, true),
        ]);
        let placement = Placement::new(&map);
        let mut moved_to = [0usize; 4];
        for n in 0..2000u32 {
            let key = format!("k{n}");
            let (key, block) = (key.as_bytes(), n % 7);
            let normal = placement.server_for(key, block, false).unwrap();
            assert_eq!(
                placement.server_skipping(key, block, false, &[]),
                Some(normal)
            );
            let skipping_d0 = placement.server_skipping(key, block, false, &[0]).unwrap();
            if normal == 0 {
                assert_ne!(skipping_d0, 0);
                moved_to[skipping_d0] += 1;
            } else {
                assert_eq!(skipping_d0, normal, "a block off the skipped server stays");
            }
            // With both DRAM servers skipped everything goes to the weighted NVMe server, and
            // with every weighted server skipped to the weight-0 one, with equal weights.
            assert_eq!(
                placement.server_skipping(key, block, false, &[0, 1]),
                Some(2)
            );
            assert_eq!(
                placement.server_skipping(key, block, false, &[0, 1, 2]),
                Some(3)
            );
            assert_eq!(
                placement.server_skipping(key, block, false, &[0, 1, 2, 3]),
                None
            );
            // PERSIST: the long-running servers with weight, then the other long-running one.
            let persist = placement.server_for(key, block, true).unwrap();
            assert!(persist == 0 || persist == 1);
            let other = placement
                .server_skipping(key, block, true, &[persist])
                .unwrap();
            assert!(other == 0 || other == 1);
            assert_ne!(other, persist);
            assert_eq!(
                placement.server_skipping(key, block, true, &[0, 1]),
                Some(3)
            );
            assert_eq!(
                placement.server_skipping(key, block, true, &[0, 1, 3]),
                None
            );
        }
        // The skipped server's blocks spread over the others by weight (0.3 : 0.5).
        assert_eq!(moved_to[0], 0);
        assert_eq!(
            moved_to[3], 0,
            "a weight-0 server takes nothing while others can"
        );
        assert!(
            moved_to[1] > 50 && moved_to[2] > moved_to[1],
            "{moved_to:?}"
        );
    }

    #[test]
    fn pool_members_outside_the_map_are_ignored() {
        let map = servers(&[("d0", 1.0, true), ("d1", 1.0, false), ("n0", 0.0, false)]);
        let pools: [(&str, &[&str]); 3] = [
            ("gone", &["x0", "x1"]),
            ("half", &["n0", "n9"]),
            ("dram", &["d0", "d1"]),
        ];
        let r = routes(&pools, &[("g", "gone"), ("h", "half"), ("h/g", "gone")]).unwrap();
        let routed = Placement::with_routes(&map, r);
        let plain = Placement::new(&map);
        for n in 0..100u32 {
            let key = format!("h/{n}");
            assert_eq!(routed.server_for(key.as_bytes(), 0, false), Some(2));
            // A pool with no server in the map routes nothing: the default placement applies,
            // also under a shorter route that would match.
            for key in [format!("g/{n}"), format!("h/g/{n}")] {
                let got = routed.server_for(key.as_bytes(), 1, false);
                assert_eq!(got, plain.server_for(key.as_bytes(), 1, false), "{key}");
            }
        }
    }
}
