//! The placement cases of `tests/vectors/placement.json` (shared with the Python test suite):
//! the Rust placement picks and ranks exactly as `pocketflow/placement.py` does. A case may carry
//! a weight map's `"pools"` and `"routes"`, which its placement applies.

use std::collections::BTreeMap;

use pocketflow_client::placement::{PlacedServer, Placement, Routes};
use serde_json::Value;

const VECTORS: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../tests/vectors/placement.json"
));

#[test]
fn placement_matches_the_shared_vectors() {
    let doc: Value = serde_json::from_str(VECTORS).expect("the vector file is JSON");
    let cases = doc["cases"].as_array().expect("cases");
    assert!(!cases.is_empty());
    let mut checked = 0;
    for case in cases {
        let servers: Vec<PlacedServer> = case["servers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| PlacedServer {
                node_id: row[0].as_str().unwrap().to_string(),
                weight: row[1].as_f64().unwrap(),
                persist: row[2].as_bool().unwrap(),
            })
            .collect();
        let name = case["name"].as_str().unwrap();
        let placement = Placement::with_routes(&servers, routes_of(case));
        for pick in case["server_for"].as_array().unwrap() {
            let key = pick[0].as_str().unwrap();
            let block = pick[1].as_u64().unwrap() as u32;
            let persist = pick[2].as_bool().unwrap();
            let got = placement
                .server_for(key.as_bytes(), block, persist)
                .map(|i| servers[i].node_id.as_str());
            assert_eq!(
                got,
                pick[3].as_str(),
                "{name}: {key:?} block {block} persist {persist}"
            );
            checked += 1;
        }
        for rank in case["ranked"].as_array().unwrap() {
            let key = rank[0].as_str().unwrap();
            let block = rank[1].as_u64().unwrap() as u32;
            let got: Vec<&str> = placement
                .ranked(key.as_bytes(), block)
                .into_iter()
                .map(|i| servers[i].node_id.as_str())
                .collect();
            let expected: Vec<&str> = rank[2]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect();
            assert_eq!(got, expected, "{name}: ranking of {key:?} block {block}");
        }
    }
    assert_eq!(checked, 501);
}

/// The routes of a case (`"pools"` and `"routes"` as in a weight map; none when absent).
fn routes_of(case: &Value) -> Routes {
    let pools: BTreeMap<String, Vec<String>> = case
        .get("pools")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .map(|(name, members)| {
            let members = members.as_array().unwrap();
            let ids = members.iter().map(|id| id.as_str().unwrap().to_string());
            (name.clone(), ids.collect())
        })
        .collect();
    let routes: BTreeMap<String, String> = case
        .get("routes")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .map(|(prefix, pool)| (prefix.clone(), pool.as_str().unwrap().to_string()))
        .collect();
    Routes::new(pools, routes).expect("the case's routes are well formed")
}
