//! Weighted rendezvous hashing: which server of a job's weight map holds block `i` of key `k`.
//!
//! The same function as `pocketflow/placement.py`, bit for bit: `(key, block)` is hashed once
//! (BLAKE2b, 8 bytes, the block index appended as 4 little-endian bytes); each server has a
//! 64-bit seed (BLAKE2b of its node id, personalization `pf-seed`); a pair's score on a server
//! is `-weight / ln(u)` with `u` in (0, 1) from a SplitMix64 mix of the hash and the seed; the
//! highest score wins. `tests/vectors/placement.json` (at the repository root) holds cases both
//! test suites check.

use blake2::digest::consts::U8;
use blake2::digest::{Mac, Update};
use blake2::{Blake2b, Blake2bMac, Digest};

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
const MIX_1: u64 = 0xBF58_476D_1CE4_E5B9;
const MIX_2: u64 = 0x94D0_49BB_1331_11EB;
const TWO_POW_MINUS_53: f64 = 1.0 / (1u64 << 53) as f64;
/// Weight given to weight-0 servers when ranking every server for fallback reads.
const RANK_WEIGHT_OF_ZERO: f64 = 1e-9;

/// 64-bit hash of `(key, block index)`.
pub fn hash_block(key: &[u8], block: u32) -> u64 {
    let mut hasher = Blake2b::<U8>::new();
    Digest::update(&mut hasher, key);
    Digest::update(&mut hasher, block.to_le_bytes());
    u64::from_le_bytes(hasher.finalize().into())
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
        let mut best = self.members[0].0;
        if self.uniform {
            // Equal weights: the largest mixed value wins, no logarithm needed.
            let mut best_mix = 0u64;
            for (i, &(index, seed, _)) in self.members.iter().enumerate() {
                let z = mix(h, seed);
                if i == 0 || z > best_mix {
                    best_mix = z;
                    best = index;
                }
            }
        } else {
            let mut best_score = f64::NEG_INFINITY;
            for &(index, seed, weight) in &self.members {
                let s = score(h, seed, weight);
                if s > best_score {
                    best_score = s;
                    best = index;
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
}

impl Placement {
    /// Placement over `servers` (in weight-map order; results are indexes into it).
    pub fn new(servers: &[PlacedServer]) -> Placement {
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
        Placement {
            ephemeral,
            persist,
            all,
        }
    }

    /// The index of the server that holds block `block` of `key`; `None` when no server can
    /// (no server with weight > 0, or none long-running for `persist`).
    pub fn server_for(&self, key: &[u8], block: u32, persist: bool) -> Option<usize> {
        let pool = if persist {
            self.persist.as_ref()
        } else {
            self.ephemeral.as_ref()
        };
        pool.map(|p| p.pick(hash_block(key, block)))
    }

    /// Every server of the map, best-scoring first (the order fallback reads probe in).
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
}
