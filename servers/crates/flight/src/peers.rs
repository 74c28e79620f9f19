//! Connections per peer address: a count per remote IP that a connection holds a place in while
//! it lives, so that one peer cannot take every place of a bounded pool.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// How many places of one pool each peer holds. The table holds only peers with a place, so it
/// has at most as many entries as the pool has places.
#[derive(Default)]
pub struct PeerCounts {
    counts: Mutex<HashMap<IpAddr, usize>>,
}

/// One place of a peer in a [`PeerCounts`]; given back on drop.
pub struct PeerPlace {
    table: Arc<PeerCounts>,
    peer: IpAddr,
}

impl PeerCounts {
    /// A place for `peer` if it holds fewer than `max`; `None` at its bound.
    pub fn enter(table: &Arc<PeerCounts>, peer: IpAddr, max: usize) -> Option<PeerPlace> {
        let mut counts = table.counts.lock().expect("peer table lock");
        let held = counts.entry(peer).or_default();
        if *held >= max {
            return None;
        }
        *held += 1;
        Some(PeerPlace {
            table: table.clone(),
            peer,
        })
    }

    /// Places `peer` holds now.
    pub fn held(&self, peer: IpAddr) -> usize {
        let counts = self.counts.lock().expect("peer table lock");
        counts.get(&peer).copied().unwrap_or(0)
    }
}

impl Drop for PeerPlace {
    fn drop(&mut self) {
        let mut counts = self.table.counts.lock().expect("peer table lock");
        if let Some(held) = counts.get_mut(&self.peer) {
            *held -= 1;
            if *held == 0 {
                counts.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_at_its_bound_is_refused_alone_and_places_come_back() {
        let table = Arc::new(PeerCounts::default());
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.3".parse().unwrap();
        let held: Vec<_> = (0..3)
            .map(|_| PeerCounts::enter(&table, a, 3).unwrap())
            .collect();
        assert!(PeerCounts::enter(&table, a, 3).is_none());
        let other = PeerCounts::enter(&table, b, 3).unwrap();
        assert_eq!(table.held(a), 3);
        drop(held);
        assert_eq!(table.held(a), 0);
        assert!(table.counts.lock().unwrap().len() == 1, "a left the table");
        drop(other);
        assert!(table.counts.lock().unwrap().is_empty());
    }
}
