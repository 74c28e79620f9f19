//! The cases of `tests/vectors/units.json` (shared with the Python test suite): the one size and
//! duration grammar parses each text to its value, or refuses it.

use pocketflow_protocol::units::{parse_duration, parse_size};
use serde_json::Value;

const VECTORS: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../tests/vectors/units.json"
));

fn cases(name: &str) -> Vec<(String, Option<u64>)> {
    let doc: Value = serde_json::from_str(VECTORS).expect("the vectors are JSON");
    doc[name]
        .as_array()
        .expect("a list of cases")
        .iter()
        .map(|case| {
            let text = case[0].as_str().expect("a text").to_string();
            (text, case[1].as_u64())
        })
        .collect()
}

#[test]
fn every_size_case_parses_to_its_bytes_or_is_refused() {
    let cases = cases("sizes");
    assert!(cases.len() >= 20);
    for (text, bytes) in cases {
        let got = parse_size(&text);
        assert_eq!(got.as_ref().ok().copied(), bytes, "{text:?}: {got:?}");
    }
}

#[test]
fn every_duration_case_parses_to_its_nanoseconds_or_is_refused() {
    let cases = cases("durations");
    assert!(cases.len() >= 20);
    for (text, nanos) in cases {
        let got = parse_duration(&text).map(|d| d.as_nanos() as u64);
        assert_eq!(got.as_ref().ok().copied(), nanos, "{text:?}: {got:?}");
    }
}
