//! Where a key's blocks live under one weight map: the home of block 0 and of each data block,
//! or the typed reason there is none (no server with weight, no long-running server).
//!
//! An overflowed object's data blocks skipped the servers that were full when it was written;
//! its manifest (header flag `HEADER_FLAG_OVERFLOW`) carries them as its value, a JSON list of
//! node ids ([`Skipped`]), and every path that writes, reads or frees its blocks places them
//! with that list (docs/ARCHITECTURE.md, "Bigger than DRAM").

use bytes::Bytes;
use pocketflow_protocol::header::{ObjectHeader, HEADER_FLAG_OVERFLOW};
use pocketflow_protocol::limits::OVERFLOW_VALUE_MAX_BYTES;
use tonic::Code;

use crate::error::ClientError;
use crate::failure::{server_error, Failure};
use crate::placement::placed_block;
use crate::view::{Server, View};

/// The servers (node ids, sorted, none twice) an object's data blocks skipped because they were
/// full; empty for an object placed by its map alone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Skipped(Vec<String>);

impl Skipped {
    /// Nothing skipped.
    pub fn none() -> Skipped {
        Skipped::default()
    }

    /// What the manifest of `header`, whose record's value is `value`, says its blocks skipped:
    /// nothing unless the header has `HEADER_FLAG_OVERFLOW`, else the list in the value.
    pub fn of_record(header: &ObjectHeader, value: &[u8]) -> Result<Skipped, ClientError> {
        if header.block_count == 0 || !header.overflowed() {
            return Ok(Skipped::none());
        }
        let ids: Vec<String> = serde_json::from_slice(value).map_err(|e| {
            ClientError::Protocol(format!("an overflowed manifest's list of servers: {e}"))
        })?;
        if ids.is_empty() {
            return Err(ClientError::Protocol(
                "an overflowed manifest names no server".into(),
            ));
        }
        Ok(Skipped::of(ids))
    }

    fn of(mut ids: Vec<String>) -> Skipped {
        ids.sort_unstable();
        ids.dedup();
        Skipped(ids)
    }

    /// Whether nothing was skipped.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `node_id` is skipped.
    pub fn contains(&self, node_id: &str) -> bool {
        self.0
            .binary_search_by(|id| id.as_str().cmp(node_id))
            .is_ok()
    }

    /// These servers and `node_id`.
    pub fn with(&self, node_id: &str) -> Skipped {
        let mut ids = self.0.clone();
        ids.push(node_id.to_string());
        Skipped::of(ids)
    }

    /// The skipped node ids.
    pub fn node_ids(&self) -> &[String] {
        &self.0
    }

    /// The manifest's value that names these servers, and the header flag that goes with it;
    /// `None` when the list does not fit `OVERFLOW_VALUE_MAX_BYTES`.
    pub fn encode(&self) -> Option<(Bytes, u32)> {
        if self.is_empty() {
            return Some((Bytes::new(), 0));
        }
        let value = serde_json::to_vec(&self.0).expect("a list of strings serializes");
        (value.len() as u64 <= OVERFLOW_VALUE_MAX_BYTES)
            .then(|| (Bytes::from(value), HEADER_FLAG_OVERFLOW))
    }

    /// The indexes of the servers of `view`'s map an overflowed object's blocks do not go to:
    /// the skipped ones (servers no longer in the map are left out: placement cannot pick them
    /// anyway), and the map's suspects, which placement's fallback over weight-0 servers would
    /// otherwise pick and a write would then wait on (a reader that finds a block elsewhere
    /// probes its ranking, as after a map change).
    fn indexes(&self, view: &View) -> Vec<usize> {
        view.servers
            .iter()
            .enumerate()
            .filter(|(_, s)| self.contains(&s.node_id) || view.is_suspect(&s.node_id))
            .map(|(i, _)| i)
            .collect()
    }
}

/// What finding a large object's data blocks takes: its manifest's header and the servers its
/// blocks skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The manifest's header.
    pub header: ObjectHeader,
    /// The servers its data blocks skipped (see [`Skipped`]).
    pub skipped: Skipped,
}

impl Layout {
    /// The layout of the manifest of `header` whose record's value is `value`.
    pub fn of_record(header: ObjectHeader, value: &[u8]) -> Result<Layout, ClientError> {
        Ok(Layout {
            header,
            skipped: Skipped::of_record(&header, value)?,
        })
    }

    /// The layout of an object placed by its map alone.
    pub fn placed(header: ObjectHeader) -> Layout {
        Layout {
            header,
            skipped: Skipped::none(),
        }
    }

    /// The home of data block `block` (see [`block_home`]).
    pub(crate) fn block_home<'v>(
        &self,
        view: &'v View,
        key: &[u8],
        block: u32,
    ) -> Result<&'v Server, Failure> {
        block_home(
            view,
            key,
            block,
            self.header.block_count,
            self.header.persist(),
            &self.skipped,
        )
    }
}

/// The home of block `block` of `key`, or the typed reason there is none.
pub(crate) fn home<'v>(
    view: &'v View,
    key: &[u8],
    block: u32,
    persist: bool,
) -> Result<&'v Server, Failure> {
    view.server_for(key, block, persist).ok_or_else(|| {
        let error = if persist {
            server_error(
                Code::FailedPrecondition as i32,
                "persist_refused",
                "the job's weight map has no long-running server".into(),
            )
        } else {
            ClientError::Unavailable("the job's weight map has no server with weight > 0".into())
        };
        Failure::local(error)
    })
}

/// The home of data block `block` of an object of `block_count` data blocks (any count above
/// one for a streamed upload that knows no more): where placement puts
/// `(key, placed_block(block, block_count))`, so an object of one data block lives whole on its
/// manifest's home; for an overflowed object, the same pick without the `skipped` servers
/// (`Placement::server_skipping`). Every path that writes, reads or frees a data block asks
/// this.
pub(crate) fn block_home<'v>(
    view: &'v View,
    key: &[u8],
    block: u32,
    block_count: u32,
    persist: bool,
    skipped: &Skipped,
) -> Result<&'v Server, Failure> {
    let placed = placed_block(block, block_count);
    if skipped.is_empty() {
        return home(view, key, placed, persist);
    }
    view.placement
        .server_skipping(key, placed, persist, &skipped.indexes(view))
        .map(|i| &view.servers[i])
        .ok_or_else(|| {
            Failure::local(server_error(
                Code::ResourceExhausted as i32,
                "capacity_exhausted",
                format!(
                    "every server the job may put this object on is full ({} skipped)",
                    skipped.node_ids().join(", ")
                ),
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manifest_names_what_its_blocks_skipped() {
        let plain = ObjectHeader {
            version: 1,
            size: 10,
            block_count: 1,
            block_size: 16,
            flags: 0,
        };
        assert!(Skipped::of_record(&plain, b"").unwrap().is_empty());
        let skipped = Skipped::none().with("dram-1").with("dram-0").with("dram-1");
        assert_eq!(skipped.node_ids(), ["dram-0", "dram-1"]);
        let (value, flag) = skipped.encode().unwrap();
        assert_eq!(&value[..], br#"["dram-0","dram-1"]"#);
        let overflowed = ObjectHeader {
            flags: flag,
            ..plain
        };
        assert!(overflowed.overflowed() && overflowed.value_len_ok(value.len() as u64));
        assert_eq!(Skipped::of_record(&overflowed, &value).unwrap(), skipped);
        assert!(Skipped::of_record(&overflowed, b"[]").is_err());
        assert!(Skipped::of_record(&overflowed, b"not json").is_err());
        let many = (0..400).fold(Skipped::none(), |s, i| s.with(&format!("server-{i:04}")));
        assert!(
            many.encode().is_none(),
            "a list over OVERFLOW_VALUE_MAX_BYTES"
        );
    }

    #[test]
    fn an_overflowed_block_never_goes_to_a_suspect() {
        // dram-0 takes the job's data; both NVMe servers are in the map at weight 0 and nvme-1
        // is suspected (hung): with dram-0 full, every block goes to nvme-0.
        let map = |suspects: &str| {
            format!(
                r#"{{"job":"j1","name":"n","epoch":2,"token":"t","block_size":1048576,
                "servers":[["dram-0","127.0.0.1:5000","dram",1,1],
                           ["nvme-0","127.0.0.1:5001","nvme",0,1],
                           ["nvme-1","127.0.0.1:5002","nvme",0,1]]{suspects}}}"#
            )
        };
        let skipped = Skipped::none().with("dram-0");
        let plain = View::from_handle_json(&map("")).unwrap();
        let suspecting = View::from_handle_json(&map(r#","suspects":["nvme-1"]"#)).unwrap();
        let mut to_nvme_1 = 0;
        for n in 0..200u32 {
            let key = format!("k{n}");
            for persist in [false, true] {
                let home = block_home(&suspecting, key.as_bytes(), 1, 3, persist, &skipped);
                assert_eq!(home.unwrap().node_id, "nvme-0", "{key} persist={persist}");
                let home = block_home(&plain, key.as_bytes(), 1, 3, persist, &skipped);
                to_nvme_1 += usize::from(home.unwrap().node_id == "nvme-1");
            }
        }
        assert!(
            to_nvme_1 > 50,
            "without the suspicion nvme-1 takes its share: {to_nvme_1}"
        );
    }
}
