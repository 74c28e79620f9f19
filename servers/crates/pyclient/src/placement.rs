//! `Placement`: weighted rendezvous placement over one weight map (the only implementation the
//! Python side places with).

use std::collections::BTreeMap;

use pocketflow_client::placement::{PlacedServer, Placement, Routes};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::errors::to_py_err;

/// Weighted rendezvous placement over one weight map (`pocketflow_client::placement`, the same
/// placement `pocketflow/placement.py` wraps): one key, or a batch in one call.
#[pyclass(name = "Placement", module = "pocketflow._core", frozen)]
pub(crate) struct PyPlacement {
    placement: Placement,
}

#[pymethods]
impl PyPlacement {
    /// `servers` holds `(node_id, weight, persist)` in the weight map's order; `pools` (name ->
    /// node ids) and `routes` (key prefix -> pool name) are the map's optional prefix routes.
    #[new]
    #[pyo3(signature = (servers, pools=None, routes=None))]
    fn new(
        py: Python<'_>,
        servers: Vec<(String, f64, bool)>,
        pools: Option<BTreeMap<String, Vec<String>>>,
        routes: Option<BTreeMap<String, String>>,
    ) -> PyResult<Self> {
        let routes = Routes::new(pools.unwrap_or_default(), routes.unwrap_or_default())
            .map_err(|e| to_py_err(py, &e, ""))?;
        let placed: Vec<PlacedServer> = servers
            .into_iter()
            .map(|(node_id, weight, persist)| PlacedServer {
                node_id,
                weight,
                persist,
            })
            .collect();
        Ok(PyPlacement {
            placement: Placement::with_routes(&placed, routes),
        })
    }

    /// The index (in the map's order) of the server for block `block` of each key (`bytes`),
    /// or -1 where no server can hold it.
    #[pyo3(signature = (keys, block=0, persist=false))]
    fn servers_for(
        &self,
        keys: &Bound<'_, PyList>,
        block: u32,
        persist: bool,
    ) -> PyResult<Vec<i64>> {
        let mut out = Vec::with_capacity(keys.len());
        for key in keys.iter() {
            let key = key.cast::<PyBytes>()?;
            out.push(
                self.placement
                    .server_for(key.as_bytes(), block, persist)
                    .map_or(-1, |i| i as i64),
            );
        }
        Ok(out)
    }

    /// The index of the server for block `block` of `key`, or -1 where no server can hold it.
    #[pyo3(signature = (key, block=0, persist=false))]
    fn server_for(&self, key: &[u8], block: u32, persist: bool) -> i64 {
        self.placement
            .server_for(key, block, persist)
            .map_or(-1, |i| i as i64)
    }

    /// Every server's index, best-scoring first for block `block` of `key` (the order fallback
    /// reads probe in; routes play no part).
    #[pyo3(signature = (key, block=0))]
    fn ranked(&self, key: &[u8], block: u32) -> Vec<usize> {
        self.placement.ranked(key, block)
    }

    /// Whether PERSIST objects can be placed at all.
    fn has_persist(&self) -> bool {
        self.placement.has_persist()
    }
}

/// The block index placement hashes for data block `block` of an object of `block_count` data
/// blocks (`pocketflow_client::placement::placed_block`).
#[pyfunction]
pub(crate) fn placed_block(block: u32, block_count: u32) -> u32 {
    pocketflow_client::placement::placed_block(block, block_count)
}
