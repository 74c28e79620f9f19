//! Property tests that fuzz every decoder of the wire protocol with arbitrary, boundary-sized and
//! mutated input: exchange request and reply frames, object headers, batch metadata, IPC pieces,
//! direct-exchange heads and statuses, a connection's first bytes and HTTP/2 opening (preface
//! and SETTINGS), DoGet tickets, DoPut and DoExchange descriptors, the body of
//! every action, action names and capability tokens.
//!
//! Each decoder must return a value or its typed error, never panic; an error's message must stay
//! short enough for a status; what a decoder accepts must meet the rules it is there to enforce;
//! and what the encoders write must decode to itself. The run is bounded: every property runs
//! `PROPTEST_CASES` cases (`CASES_DEFAULT` when unset) and failures are not persisted to files.

use bytes::Bytes;
use pocketflow_protocol::action::{
    ActionName, AnyRequest, BucketRequest, DeleteBlocksRequest, DeleteJobRequest, DrainRequest,
    EndLeasesRequest, EnumerateRequest, EventsRequest, ObjectRequest, PrefixRequest,
    RenewLeasesRequest, SetCoresRequest, SetEpochRequest, SubscribeRequest, WaitRequest,
};
use pocketflow_protocol::batch::{GetPieceMeta, PutPieceMeta};
use pocketflow_protocol::context::parse_json;
use pocketflow_protocol::descriptor::{ExchangeDescriptor, PutDescriptor};
use pocketflow_protocol::direct::{
    decode_head, decode_status, encode_head, encode_message, encode_status, Kind, DIRECT_MAGIC,
    MESSAGE_HEAD_BYTES, PAYLOAD_MAX_BYTES,
};
use pocketflow_protocol::frame::{
    decode_reply_frame, decode_request_frame, encode_request_frame, OpCode, Reply,
    ReplyFrameBuilder, RequestOp, OP_FLAG_CLAIM_WHOLE, OP_FLAG_DELETE, OP_FLAG_OVERWRITE,
    OP_FLAG_PERSIST, OP_FLAG_SEAL, REQUEST_FRAME_HEAD_BYTES, REQUEST_OP_HEAD_BYTES,
};
use pocketflow_protocol::ipc::{check_schema, decode_piece, encode_piece, is_schema_message};
use pocketflow_protocol::limits::{
    BLOCK_SIZE_MAX_BYTES, BUCKET_NAME_MAX_BYTES, ENUMERATE_LIMIT_MAX, EVENTS_BATCH_MAX,
    FRAME_MAX_BYTES, FRAME_OPS_MAX, JOB_ID_MAX_BYTES, KEY_MAX_BYTES, LEASE_MS_MAX, LEASE_MS_MIN,
    LEASE_PREFIXES_MAX, SMALL_OBJECT_MAX_BYTES, SUBSCRIBER_EVENTS_MAX, TICKET_RANGES_MAX,
    WAIT_KEYS_MAX, WAIT_TIMEOUT_MAX_MS,
};
use pocketflow_protocol::opening::{
    first_bytes, http2_opening, FirstBytes, Http2Opening, CLIENT_PREFACE, FRAME_SETTINGS,
    HTTP2_OPENING_MAX_BYTES, TLS_HANDSHAKE_RECORD,
};
use pocketflow_protocol::ticket::{GetTicket, ReadTicket};
use pocketflow_protocol::token::TokenKey;
use pocketflow_protocol::{
    Context, ErrorKind, ObjectHeader, ProtocolError, TokenError, HEADER_FLAGS_KNOWN,
    HEADER_FLAG_FENCE, HEADER_FLAG_OVERFLOW, HEADER_FLAG_PERSIST, HEADER_LEN_BYTES,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use serde_json::{json, Map, Value};

/// Cases per property when `PROPTEST_CASES` is unset: the whole file then runs in a few seconds
/// in release mode.
const CASES_DEFAULT: u32 = 2048;

/// Longest error message accepted: errors become status messages, which must not echo a large
/// request back.
const ERROR_MESSAGE_MAX_BYTES: usize = 1024;

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(CASES_DEFAULT);
    ProptestConfig {
        cases,
        // Keep failing seeds out of the source tree; a failure prints its minimal input instead.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---- Refusals ----

/// A refusal is a typed error of the kind its variant promises, with a short message.
fn check_refusal(error: &ProtocolError) {
    let text = error.to_string();
    assert!(!text.is_empty());
    assert!(
        text.len() <= ERROR_MESSAGE_MAX_BYTES,
        "error message of {} bytes: {}...",
        text.len(),
        text.chars().take(200).collect::<String>()
    );
    let expected = match error {
        ProtocolError::Token(_) => ErrorKind::PermissionDenied,
        _ => ErrorKind::InvalidArgument,
    };
    assert_eq!(error.kind(), expected, "{error}");
}

/// The value of a decoder, after checking its refusal if it refused.
fn checked<T>(result: Result<T, ProtocolError>) -> Option<T> {
    result.map_err(|error| check_refusal(&error)).ok()
}

// ---- Mutations of valid encodings ----

/// One change to an encoding; positions are taken modulo the buffer's length.
#[derive(Clone, Debug)]
enum Mutation {
    /// XOR one byte with a non-zero mask.
    Flip { at: usize, mask: u8 },
    /// Overwrite four bytes (a length or count, perhaps) with a value near a bound.
    Word { at: usize, value: u32 },
    /// Overwrite two bytes with a value near a bound.
    Half { at: usize, value: u16 },
    /// Cut the buffer to a length.
    Truncate { len: usize },
    /// Append bytes.
    Extend(Vec<u8>),
    /// Insert bytes.
    Insert { at: usize, bytes: Vec<u8> },
    /// Remove a run of bytes.
    Remove { at: usize, len: usize },
}

/// Values around the bounds of lengths and counts.
const WORDS: [u32; 18] = [
    0,
    1,
    2,
    32,
    52,
    255,
    256,
    65_535,
    65_536,
    65_537,
    FRAME_OPS_MAX,
    FRAME_OPS_MAX + 1,
    FRAME_MAX_BYTES as u32,
    FRAME_MAX_BYTES as u32 + 1,
    BLOCK_SIZE_MAX_BYTES,
    BLOCK_SIZE_MAX_BYTES + 1,
    i32::MAX as u32,
    u32::MAX,
];

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 1..=u8::MAX).prop_map(|(at, mask)| Mutation::Flip { at, mask }),
        2 => (any::<usize>(), select(WORDS.to_vec()))
            .prop_map(|(at, value)| Mutation::Word { at, value }),
        1 => (any::<usize>(), select(WORDS.to_vec()))
            .prop_map(|(at, value)| Mutation::Half { at, value: value as u16 }),
        1 => any::<usize>().prop_map(|len| Mutation::Truncate { len }),
        1 => vec(any::<u8>(), 1..16).prop_map(Mutation::Extend),
        1 => (any::<usize>(), vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (any::<usize>(), 1..64usize).prop_map(|(at, len)| Mutation::Remove { at, len }),
    ]
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    vec(mutation(), 1..4)
}

fn mutate(bytes: &[u8], mutations: &[Mutation]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    for change in mutations {
        let len = out.len();
        match change {
            Mutation::Flip { at, mask } if len > 0 => out[at % len] ^= mask,
            Mutation::Word { at, value } if len >= 4 => {
                let i = at % (len - 3);
                out[i..i + 4].copy_from_slice(&value.to_le_bytes());
            }
            Mutation::Half { at, value } if len >= 2 => {
                let i = at % (len - 1);
                out[i..i + 2].copy_from_slice(&value.to_le_bytes());
            }
            Mutation::Truncate { len: cut } => out.truncate(cut % (len + 1)),
            Mutation::Extend(more) => out.extend_from_slice(more),
            Mutation::Insert { at, bytes } => {
                let i = at % (len + 1);
                out.splice(i..i, bytes.iter().copied());
            }
            Mutation::Remove { at, len: run } if len > 0 => {
                let i = at % len;
                out.drain(i..(i + run).min(len));
            }
            _ => {}
        }
    }
    out
}

// ---- Values ----

/// Text of 1..=`max` bytes: short ASCII, short Unicode, or exactly `max` bytes (ending in a
/// two-byte character, so the bound falls on a character's last byte).
fn name(max: usize) -> BoxedStrategy<String> {
    prop_oneof![
        4 => "[a-z0-9/._-]{1,12}",
        2 => "\\PC{1,6}",
        1 => Just("n".repeat(max)),
        1 => Just(format!("{}é", "n".repeat(max - 2))),
    ]
    .boxed()
}

/// Text whose length in bytes sits around the bounds of names, keys and prefixes, including
/// control characters, or short arbitrary text.
fn text_near_bounds() -> BoxedStrategy<String> {
    let lens = vec![
        0usize, 1, 2, 64, 127, 128, 129, 254, 255, 256, 1023, 1024, 1025, 4096,
    ];
    let chars = vec!['k', 'é', '\n', '\0', '\u{7f}', '\u{10348}'];
    prop_oneof![
        3 => (select(lens), select(chars)).prop_map(|(n, c)| std::iter::repeat_n(c, n).collect()),
        2 => "\\PC{0,8}",
        1 => any::<String>(),
    ]
    .boxed()
}

/// Integers around the bounds of versions, limits, block sizes and timeouts.
const NUMBERS: [u64; 22] = [
    0,
    1,
    2,
    255,
    256,
    1024,
    1025,
    4096,
    4097,
    10_000,
    10_001,
    30_000,
    30_001,
    65_536,
    BLOCK_SIZE_MAX_BYTES as u64,
    BLOCK_SIZE_MAX_BYTES as u64 + 1,
    u32::MAX as u64,
    u32::MAX as u64 + 1,
    i64::MAX as u64,
    u64::MAX - 1,
    u64::MAX,
    1 << 53,
];

fn number() -> BoxedStrategy<Value> {
    prop_oneof![
        4 => select(NUMBERS.to_vec()).prop_map(Value::from),
        1 => any::<i64>().prop_map(Value::from),
        1 => any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
    ]
    .boxed()
}

/// Field names of every JSON request, plus names no request has.
const FIELDS: [&str; 27] = [
    "ctx",
    "job",
    "epoch",
    "token",
    "bucket",
    "key",
    "version",
    "blocks",
    "prefix",
    "start_after",
    "limit",
    "map",
    "exit_when_empty",
    "cores",
    "keys",
    "timeout_ms",
    "ranges",
    "delete",
    "block_size",
    "persist",
    "ops",
    "capacity",
    "subscription",
    "max",
    "prefixes",
    "lease_ms",
    "extra",
];

/// Any JSON value, a few levels deep, built from boundary values.
fn json_value() -> BoxedStrategy<Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        text_near_bounds().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::Array),
            vec((select(FIELDS.to_vec()), inner), 0..4).prop_map(|pairs| {
                Value::Object(pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
            }),
        ]
    })
    .boxed()
}

/// A token-shaped string: a decimal expiry, a dot and 64 hex digits (with no valid MAC).
fn token_text() -> BoxedStrategy<String> {
    prop_oneof!["[0-9]{1,20}\\.[0-9a-fA-F]{64}", text_near_bounds(),].boxed()
}

/// A `ctx` object: mostly well formed, sometimes any JSON value.
fn ctx_value() -> BoxedStrategy<Value> {
    prop_oneof![
        4 => (prop_oneof![name(JOB_ID_MAX_BYTES), text_near_bounds()], number(), token_text())
            .prop_map(|(job, epoch, token)| json!({"job": job, "epoch": epoch, "token": token})),
        1 => json_value(),
    ]
    .boxed()
}

/// A value for one request field: mostly of the field's type, with values near its bounds.
fn field_value(field: &'static str) -> BoxedStrategy<Value> {
    let typed = match field {
        "ctx" => ctx_value(),
        "bucket" | "key" | "prefix" | "start_after" | "job" => {
            prop_oneof![name(BUCKET_NAME_MAX_BYTES), text_near_bounds()]
                .prop_map(Value::String)
                .boxed()
        }
        "token" => token_text().prop_map(Value::String).boxed(),
        "version" | "epoch" | "limit" | "cores" | "timeout_ms" | "block_size" => prop_oneof![
            4 => number(),
            1 => text_near_bounds().prop_map(Value::String),
        ]
        .boxed(),
        "blocks" => vec(number(), 0..4).prop_map(Value::Array).boxed(),
        "keys" => prop_oneof![
            4 => vec(text_near_bounds().prop_map(Value::String), 0..4).prop_map(Value::Array),
            1 => (WAIT_KEYS_MAX..=WAIT_KEYS_MAX + 1)
                .prop_map(|n| Value::Array((0..n).map(|i| Value::from(format!("k{i}"))).collect())),
        ]
        .boxed(),
        "ranges" => vec(
            (number(), number(), number()).prop_map(|(i, o, l)| json!([i, o, l])),
            0..4,
        )
        .prop_map(Value::Array)
        .boxed(),
        "exit_when_empty" | "delete" | "persist" => any::<bool>().prop_map(Value::Bool).boxed(),
        "capacity" | "subscription" | "max" | "lease_ms" => number(),
        "ops" => vec(
            prop_oneof![
                Just("put".to_string()),
                Just("lease_expired".to_string()),
                text_near_bounds()
            ]
            .prop_map(Value::String),
            0..7,
        )
        .prop_map(Value::Array)
        .boxed(),
        "prefixes" => vec(text_near_bounds().prop_map(Value::String), 0..4)
            .prop_map(Value::Array)
            .boxed(),
        _ => json_value(),
    };
    prop_oneof![4 => typed, 1 => json_value()].boxed()
}

/// A JSON request object: each known field present or not, typed or not.
fn request_object() -> BoxedStrategy<Map<String, Value>> {
    let fields: Vec<_> = FIELDS
        .iter()
        .map(|field| {
            proptest::option::weighted(0.7, field_value(field))
                .prop_map(move |value| value.map(|value| ((*field).to_owned(), value)))
        })
        .collect();
    fields
        .prop_map(|pairs| pairs.into_iter().flatten().collect())
        .boxed()
}

/// Bytes for a JSON decoder, with the request object they encode when they encode one.
type JsonInput = (Option<Map<String, Value>>, Vec<u8>);

/// Bytes a JSON decoder may see: a request object as JSON, that JSON mutated, or raw bytes.
fn json_input() -> BoxedStrategy<JsonInput> {
    prop_oneof![
        4 => request_object().prop_map(|object| {
            let body = serde_json::to_vec(&object).expect("JSON serializes");
            (Some(object), body)
        }),
        2 => (request_object(), mutations()).prop_map(|(object, changes)| {
            let body = serde_json::to_vec(&object).expect("JSON serializes");
            (None, mutate(&body, &changes))
        }),
        1 => vec(any::<u8>(), 0..128).prop_map(|bytes| (None, bytes)),
        1 => (0usize..=200).prop_map(|depth| (None, nested(depth))),
    ]
    .boxed()
}

/// JSON nested `depth` levels deep under `map` (serde_json refuses depths past 128).
fn nested(depth: usize) -> Vec<u8> {
    let ctx = r#"{"job":"j","token":"t"}"#;
    format!(
        r#"{{"ctx":{ctx},"job":"j","epoch":1,"map":{}1{}}}"#,
        "[".repeat(depth),
        "]".repeat(depth)
    )
    .into_bytes()
}

// ---- Rules a decoder must enforce on what it accepts ----

fn assert_len(what: &str, text: &str, min: usize, max: usize) {
    assert!(
        (min..=max).contains(&text.len()),
        "accepted {what} of {} bytes",
        text.len()
    );
}

fn assert_job(job: &str) {
    assert_len("job", job, 1, JOB_ID_MAX_BYTES);
    assert!(!job.chars().any(char::is_control), "accepted job {job:?}");
}

/// Required fields of a JSON request: a body that lacks one (or has it null) must be refused.
fn assert_present(object: Option<&Map<String, Value>>, required: &[&str], what: &str) {
    let Some(object) = object else { return };
    for field in required {
        let value = object.get(*field);
        assert!(
            value.is_some_and(|value| !value.is_null()),
            "{what} accepted without {field}"
        );
    }
    // serde also reads a struct from an array of its fields in order (`"ctx": ["job"]`); that
    // form keeps every rule, so only the object form is checked for its `job` here.
    let ctx = object.get("ctx").expect("checked above");
    if !ctx.is_array() {
        assert!(
            ctx.get("job").is_some_and(Value::is_string),
            "{what} accepted without ctx.job"
        );
    }
}

fn required_fields(action: ActionName) -> &'static [&'static str] {
    match action {
        ActionName::Lookup | ActionName::Delete => &["ctx", "bucket", "key"],
        ActionName::DeleteBlocks => &["ctx", "bucket", "key", "version", "blocks"],
        ActionName::Enumerate | ActionName::CreateBucket | ActionName::DeleteBucket => {
            &["ctx", "bucket"]
        }
        ActionName::DeletePrefix => &["ctx", "bucket", "prefix"],
        ActionName::DeleteJob | ActionName::Stats | ActionName::Drain => &["ctx"],
        ActionName::SetEpoch => &["ctx", "job", "epoch"],
        ActionName::SetCores => &["ctx", "cores"],
        ActionName::Wait => &["ctx", "bucket", "keys", "timeout_ms"],
        ActionName::Subscribe => &["ctx", "bucket", "ops"],
        ActionName::Events | ActionName::Unsubscribe => &["ctx", "subscription"],
        ActionName::RenewLeases => &["ctx", "prefixes", "lease_ms"],
        ActionName::EndLeases => &["ctx", "prefixes"],
    }
}

/// Decode an action body as the service does (`crates/flight/src/action.rs`: the `ctx` first,
/// then the action's request) and check what was accepted against the action's rules.
fn parse_action(action: ActionName, body: &[u8]) -> Result<(), ProtocolError> {
    parse_json::<AnyRequest>("action body", body)?;
    match action {
        ActionName::Lookup | ActionName::Delete => {
            let req = ObjectRequest::parse(body)?;
            assert_len("bucket", &req.bucket, 1, BUCKET_NAME_MAX_BYTES);
            assert_len("key", &req.key, 1, KEY_MAX_BYTES);
        }
        ActionName::DeleteBlocks => {
            let req = DeleteBlocksRequest::parse(body)?;
            assert_len("bucket", &req.bucket, 1, BUCKET_NAME_MAX_BYTES);
            assert_len("key", &req.key, 1, KEY_MAX_BYTES);
            assert!(req.version != 0 && !req.blocks.contains(&0), "{req:?}");
        }
        ActionName::Enumerate => {
            let req = EnumerateRequest::parse(body)?;
            assert_len("bucket", &req.bucket, 1, BUCKET_NAME_MAX_BYTES);
            assert_len("prefix", &req.prefix, 0, KEY_MAX_BYTES);
            if let Some(after) = &req.start_after {
                assert_len("start_after", after, 0, KEY_MAX_BYTES);
            }
            assert!((1..=ENUMERATE_LIMIT_MAX).contains(&req.limit), "{req:?}");
        }
        ActionName::CreateBucket | ActionName::DeleteBucket => {
            let req = BucketRequest::parse(body)?;
            assert_len("bucket", &req.bucket, 1, BUCKET_NAME_MAX_BYTES);
        }
        ActionName::DeletePrefix => {
            let req = PrefixRequest::parse(body)?;
            assert_len("bucket", &req.bucket, 1, BUCKET_NAME_MAX_BYTES);
            assert_len("prefix", &req.prefix, 0, KEY_MAX_BYTES);
        }
        ActionName::DeleteJob => {
            if let Some(job) = DeleteJobRequest::parse(body)?.job {
                assert_job(&job);
            }
        }
        ActionName::SetEpoch => {
            let req = SetEpochRequest::parse(body)?;
            assert_job(&req.job);
            assert!(req.epoch >= 1);
            req.map_json()?;
        }
        ActionName::Stats => {}
        ActionName::Drain => {
            DrainRequest::parse(body)?;
        }
        ActionName::SetCores => {
            assert!(SetCoresRequest::parse(body)?.cores >= 1);
        }
        ActionName::Wait => {
            let req = WaitRequest::parse(body)?;
            assert_len("bucket", &req.bucket, 1, BUCKET_NAME_MAX_BYTES);
            assert!((1..=WAIT_KEYS_MAX).contains(&req.keys.len()));
            for key in &req.keys {
                assert_len("key", key, 1, KEY_MAX_BYTES);
            }
            assert!(req.timeout_ms <= WAIT_TIMEOUT_MAX_MS);
        }
        ActionName::Subscribe => {
            let req = SubscribeRequest::parse(body)?;
            assert_len("bucket", &req.bucket, 1, BUCKET_NAME_MAX_BYTES);
            assert_len("prefix", &req.prefix, 0, KEY_MAX_BYTES);
            assert!((1..=5).contains(&req.ops.len()));
            assert!((1..=SUBSCRIBER_EVENTS_MAX).contains(&req.capacity));
        }
        ActionName::Events | ActionName::Unsubscribe => {
            let req = EventsRequest::parse(body)?;
            assert!(req.timeout_ms <= WAIT_TIMEOUT_MAX_MS);
            assert!((1..=EVENTS_BATCH_MAX).contains(&req.max));
        }
        ActionName::RenewLeases => {
            let req = RenewLeasesRequest::parse(body)?;
            assert!((1..=LEASE_PREFIXES_MAX).contains(&req.prefixes.len()));
            for prefix in &req.prefixes {
                assert_len("prefix", prefix, 1, KEY_MAX_BYTES);
            }
            assert!((LEASE_MS_MIN..=LEASE_MS_MAX).contains(&req.lease_ms));
        }
        ActionName::EndLeases => {
            let req = EndLeasesRequest::parse(body)?;
            assert!((1..=LEASE_PREFIXES_MAX).contains(&req.prefixes.len()));
            for prefix in &req.prefixes {
                assert_len("prefix", prefix, 1, KEY_MAX_BYTES);
            }
        }
    }
    Ok(())
}

fn assert_ticket(ticket: &GetTicket) {
    assert_job(&ticket.ctx.job);
    assert_len("bucket", &ticket.bucket, 1, BUCKET_NAME_MAX_BYTES);
    assert_len("key", &ticket.key, 1, KEY_MAX_BYTES);
    assert_ne!(ticket.version, 0);
    assert!((1..=TICKET_RANGES_MAX).contains(&ticket.ranges.len()));
    for range in &ticket.ranges {
        assert!(range.index() >= 1, "{range:?}");
        let end = u128::from(range.offset()) + u128::from(range.len());
        assert!(end <= u128::from(BLOCK_SIZE_MAX_BYTES), "{range:?}");
    }
}

fn assert_put_descriptor(descriptor: &PutDescriptor) {
    assert_job(&descriptor.ctx.job);
    assert_len("bucket", &descriptor.bucket, 1, BUCKET_NAME_MAX_BYTES);
    assert_len("key", &descriptor.key, 1, KEY_MAX_BYTES);
    assert_ne!(descriptor.version, 0);
    assert!((1..=BLOCK_SIZE_MAX_BYTES).contains(&descriptor.block_size));
}

/// A header that passes `validate` has known flags and consistent geometry (only a manifest
/// overflows), and its blocks add up to its size.
fn assert_valid_header(header: &ObjectHeader) {
    assert_ne!(header.version, 0);
    assert_eq!(header.flags & !HEADER_FLAGS_KNOWN, 0);
    if header.fence() {
        // A fence holds no bytes and lives with ephemeral records.
        assert!(
            header.size == 0 && header.block_count == 0 && !header.persist(),
            "{header:?}"
        );
    }
    if header.is_small() {
        assert!(!header.overflowed(), "{header:?}");
        assert!(header.size <= SMALL_OBJECT_MAX_BYTES && header.block_size == 0);
        assert_eq!(header.data_block_len(1), None);
    } else {
        assert!((1..=BLOCK_SIZE_MAX_BYTES).contains(&header.block_size));
        // Every block but the last is full and the last holds the rest (checked in O(1): a
        // valid header may have billions of blocks).
        let block_size = u64::from(header.block_size);
        let count = header.block_count;
        for index in [1, count / 2, count - 1]
            .into_iter()
            .filter(|i| (1..count).contains(i))
        {
            assert_eq!(header.data_block_len(index), Some(block_size), "{header:?}");
        }
        let last = header.data_block_len(count).expect("last block in range");
        assert!(last > 0 && last <= block_size, "{header:?}");
        assert_eq!(
            u64::from(count - 1) * block_size + last,
            header.size,
            "{header:?}"
        );
        assert_eq!(header.data_block_len(0), None);
        if let Some(past) = count.checked_add(1) {
            assert_eq!(header.data_block_len(past), None);
        }
    }
}

// ---- Frames ----

fn header() -> BoxedStrategy<ObjectHeader> {
    let block_size = prop_oneof![
        Just(0u32),
        Just(1),
        Just(4096),
        Just(BLOCK_SIZE_MAX_BYTES),
        Just(BLOCK_SIZE_MAX_BYTES + 1),
        any::<u32>(),
    ];
    let size = prop_oneof![
        select(NUMBERS.to_vec()),
        0..=SMALL_OBJECT_MAX_BYTES + 1,
        any::<u64>(),
    ];
    (
        prop_oneof![select(vec![0u64, 1, u64::MAX]), any::<u64>()],
        size,
        block_size,
        -1i64..=1,
        any::<u32>(),
        select(vec![
            0u32,
            HEADER_FLAG_PERSIST,
            HEADER_FLAG_FENCE,
            HEADER_FLAG_OVERFLOW,
            8,
            u32::MAX,
        ]),
    )
        .prop_map(|(version, size, block_size, skew, count, flags)| {
            // Mostly the block count that fits the size, off by one or arbitrary otherwise.
            let block_count = if block_size == 0 || count % 4 == 0 {
                count % 3
            } else {
                let fit = size.div_ceil(u64::from(block_size)) as i64 + skew;
                u32::try_from(fit).unwrap_or(count)
            };
            ObjectHeader {
                version,
                size,
                block_count,
                block_size,
                flags,
            }
        })
        .boxed()
}

fn value() -> BoxedStrategy<Bytes> {
    prop_oneof![
        20 => vec(any::<u8>(), 0..48).prop_map(Bytes::from),
        1 => Just(Bytes::from(vec![0xa5; SMALL_OBJECT_MAX_BYTES as usize])),
    ]
    .boxed()
}

fn request_op() -> BoxedStrategy<RequestOp> {
    (
        any::<u64>(),
        select(vec![
            OpCode::Put,
            OpCode::Get,
            OpCode::Delete,
            OpCode::Lookup,
            OpCode::Enqueue,
            OpCode::Dequeue,
            OpCode::QueueInfo,
            OpCode::Append,
            OpCode::ReadAppend,
            OpCode::ReadRecords,
        ]),
        any::<u8>(),
        name(BUCKET_NAME_MAX_BYTES),
        name(KEY_MAX_BYTES),
        header(),
        value(),
    )
        .prop_map(|(request_id, op, flags, bucket, key, header, value)| {
            let allowed = match op {
                OpCode::Put => OP_FLAG_PERSIST | OP_FLAG_OVERWRITE,
                OpCode::Get => OP_FLAG_DELETE | OP_FLAG_CLAIM_WHOLE,
                OpCode::QueueInfo | OpCode::ReadAppend => OP_FLAG_SEAL,
                _ => 0,
            };
            RequestOp {
                request_id,
                op,
                flags: flags & allowed,
                bucket,
                key,
                header: if op.takes_header() {
                    header
                } else {
                    Default::default()
                },
                value: if op.takes_value() {
                    value
                } else {
                    Bytes::new()
                },
            }
        })
        .boxed()
}

fn reply() -> BoxedStrategy<Reply> {
    (
        any::<u64>(),
        any::<u8>(),
        proptest::option::of(header()),
        vec(any::<u8>(), 0..48),
    )
        .prop_map(|(request_id, status, header, body)| Reply {
            request_id,
            status,
            header,
            body: Bytes::from(body),
        })
        .boxed()
}

fn reply_frame(replies: &[Reply]) -> Bytes {
    let mut builder = ReplyFrameBuilder::new();
    for reply in replies {
        assert!(builder.fits(reply));
        builder.push(reply);
    }
    builder.finish()
}

/// Raw bytes, or raw bytes behind a valid request-frame head (so they reach the op decoder).
fn frame_bytes() -> BoxedStrategy<Vec<u8>> {
    prop_oneof![
        vec(any::<u8>(), 0..256),
        (any::<u64>(), 1..=4u32, vec(any::<u8>(), 0..256)).prop_map(|(epoch, count, rest)| {
            let mut out = vec![1, 0, 0, 0];
            out.extend_from_slice(&epoch.to_le_bytes());
            out.extend_from_slice(&count.to_le_bytes());
            out.extend_from_slice(&rest);
            out
        }),
    ]
    .boxed()
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn request_frames_round_trip(epoch in any::<u64>(), ops in vec(request_op(), 1..8)) {
        let frame = encode_request_frame(epoch, &ops);
        let decoded = decode_request_frame(&frame).expect("an encoded frame decodes");
        prop_assert_eq!(decoded.epoch, epoch);
        prop_assert_eq!(&decoded.ops, &ops);
        for op in &decoded.ops {
            if checked(op.check()).is_some() && op.op == OpCode::Put {
                assert_valid_header(&op.header);
            }
        }
    }

    /// A request frame the decoder accepts is exactly what the encoder writes for its value, so
    /// no reserved byte, padding or stray length slips through.
    #[test]
    fn request_frames_accept_only_canonical_bytes(
        input in prop_oneof![
            (any::<u64>(), vec(request_op(), 1..6), mutations())
                .prop_map(|(epoch, ops, changes)| mutate(&encode_request_frame(epoch, &ops), &changes)),
            frame_bytes(),
        ]
    ) {
        let input = Bytes::from(input);
        if let Some(frame) = checked(decode_request_frame(&input)) {
            prop_assert_eq!(encode_request_frame(frame.epoch, &frame.ops), input);
            prop_assert!(!frame.ops.is_empty() && frame.ops.len() <= FRAME_OPS_MAX as usize);
            for op in &frame.ops {
                prop_assert!((1..=BUCKET_NAME_MAX_BYTES).contains(&op.bucket.len()));
                prop_assert!((1..=KEY_MAX_BYTES).contains(&op.key.len()));
                prop_assert!(op.value.len() as u64 <= SMALL_OBJECT_MAX_BYTES);
                if checked(op.check()).is_some() && op.op == OpCode::Put {
                    assert_valid_header(&op.header);
                    prop_assert!(op.header.value_len_ok(op.value.len() as u64));
                }
            }
        }
    }

    #[test]
    fn reply_frames_round_trip(replies in vec(reply(), 0..8)) {
        let frame = reply_frame(&replies);
        prop_assert_eq!(decode_reply_frame(&frame).expect("an encoded frame decodes"), replies);
    }

    #[test]
    fn reply_frames_accept_only_canonical_bytes(
        input in prop_oneof![
            (vec(reply(), 0..6), mutations())
                .prop_map(|(replies, changes)| mutate(&reply_frame(&replies), &changes)),
            vec(any::<u8>(), 0..256),
        ]
    ) {
        let input = Bytes::from(input);
        if let Some(replies) = checked(decode_reply_frame(&input)) {
            prop_assert_eq!(reply_frame(&replies), input);
        }
    }

    #[test]
    fn object_headers(
        header in header(),
        input in prop_oneof![vec(any::<u8>(), 0..48), (header(), mutations())
            .prop_map(|(h, changes)| mutate(&h.encode(), &changes))],
    ) {
        prop_assert_eq!(ObjectHeader::decode(&header.encode()), Ok(header));
        if header.validate().is_ok() {
            assert_valid_header(&header);
        }
        match ObjectHeader::decode(&input) {
            Ok(decoded) => {
                prop_assert_eq!(&decoded.encode()[..], &input[..HEADER_LEN_BYTES]);
                if decoded.validate().is_ok() {
                    assert_valid_header(&decoded);
                }
            }
            Err(error) => {
                let error = ProtocolError::from(error);
                check_refusal(&error);
            }
        }
    }

    #[test]
    fn piece_metas(
        index in any::<u32>(),
        offset in any::<u64>(),
        len in any::<u64>(),
        input in vec(any::<u8>(), 0..32),
    ) {
        let put = PutPieceMeta { block_index: index, block_len: len };
        let decoded = PutPieceMeta::decode(&put.encode());
        prop_assert_eq!(decoded.is_ok(), index != 0);
        if let Some(meta) = checked(decoded) {
            prop_assert_eq!(meta, put);
        }
        let get = GetPieceMeta { block_index: index, offset, len };
        prop_assert_eq!(GetPieceMeta::decode(&get.encode()).unwrap(), get);
        if let Some(meta) = checked(PutPieceMeta::decode(&input)) {
            prop_assert_eq!(&meta.encode()[..], &input[..]);
        }
        if let Some(meta) = checked(GetPieceMeta::decode(&input)) {
            prop_assert_eq!(&meta.encode()[..], &input[..]);
        }
    }
}

/// Frames at their size and count bounds decode; one byte or one op more is refused.
#[test]
fn frames_at_their_bounds() {
    let op = |id: u64, value_len: usize| RequestOp {
        request_id: id,
        op: OpCode::Put,
        flags: 0,
        bucket: "b".into(),
        key: "k".into(),
        header: ObjectHeader {
            version: 1,
            size: value_len as u64,
            ..Default::default()
        },
        value: Bytes::from(vec![7u8; value_len]),
    };
    // 127 ops of the largest value, and one that fills the frame to FRAME_MAX_BYTES exactly.
    let big = SMALL_OBJECT_MAX_BYTES as usize;
    let full_op = REQUEST_OP_HEAD_BYTES + 2 + big;
    let mut ops: Vec<RequestOp> = (0..127).map(|id| op(id, big)).collect();
    let rest = FRAME_MAX_BYTES - REQUEST_FRAME_HEAD_BYTES - 127 * full_op;
    ops.push(op(127, rest - REQUEST_OP_HEAD_BYTES - 2));
    let frame = encode_request_frame(1, &ops);
    assert_eq!(frame.len(), FRAME_MAX_BYTES);
    let decoded = decode_request_frame(&frame).unwrap();
    assert!(decoded.ops.iter().all(|op| op.check().is_ok()));
    let mut over = frame.to_vec();
    over.push(0);
    assert!(matches!(
        decode_request_frame(&Bytes::from(over)),
        Err(ProtocolError::FrameTooLarge(_))
    ));

    let tiny = |id: u64| RequestOp {
        request_id: id,
        op: OpCode::Lookup,
        flags: 0,
        bucket: "b".into(),
        key: "k".into(),
        header: Default::default(),
        value: Bytes::new(),
    };
    let most: Vec<RequestOp> = (0..u64::from(FRAME_OPS_MAX)).map(tiny).collect();
    assert_eq!(
        decode_request_frame(&encode_request_frame(1, &most))
            .unwrap()
            .ops
            .len(),
        FRAME_OPS_MAX as usize
    );
    let one_more: Vec<RequestOp> = (0..=u64::from(FRAME_OPS_MAX)).map(tiny).collect();
    assert!(matches!(
        decode_request_frame(&encode_request_frame(1, &one_more)),
        Err(ProtocolError::OpCount(_))
    ));

    // A reply frame filled to its bound decodes.
    let reply = Reply {
        request_id: 1,
        status: 0,
        header: None,
        body: Bytes::from(vec![1u8; big]),
    };
    let mut builder = ReplyFrameBuilder::new();
    while builder.fits(&reply) {
        builder.push(&reply);
    }
    let count = builder.count() as usize;
    assert_eq!(decode_reply_frame(&builder.finish()).unwrap().len(), count);
}

// ---- Direct exchange ----

const KINDS: [Kind; 11] = Kind::ALL;

proptest! {
    #![proptest_config(config())]

    #[test]
    fn direct_heads(
        head in prop_oneof![
            any::<[u8; MESSAGE_HEAD_BYTES]>(),
            (0u8..=12, PAYLOAD_MAX_BYTES as u32 - 2..=PAYLOAD_MAX_BYTES as u32 + 2)
                .prop_map(|(kind, len)| {
                    let n = len.to_le_bytes();
                    [kind, n[0], n[1], n[2], n[3]]
                }),
        ],
        kind in select(KINDS.to_vec()),
        len in 0..=PAYLOAD_MAX_BYTES,
    ) {
        prop_assert_eq!(decode_head(&encode_head(kind, len)).unwrap(), (kind, len));
        let decoded = checked(decode_head(&head));
        let len_ok = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize
            <= PAYLOAD_MAX_BYTES;
        prop_assert_eq!(decoded.is_some(), (1..=11).contains(&head[0]) && len_ok);
        if let Some((kind, len)) = decoded {
            prop_assert_eq!(encode_head(kind, len), head);
        }
    }

    #[test]
    fn direct_statuses(code in any::<u8>(), message in any::<String>(), input in vec(any::<u8>(), 0..64)) {
        let payload = encode_status(code, &message);
        prop_assert_eq!(decode_status(&payload).unwrap(), (code, message.clone()));
        let whole = encode_message(Kind::Status, &payload);
        let head: [u8; MESSAGE_HEAD_BYTES] = whole[..MESSAGE_HEAD_BYTES].try_into().unwrap();
        prop_assert_eq!(decode_head(&head).unwrap(), (Kind::Status, payload.len()));
        let decoded = checked(decode_status(&input));
        prop_assert_eq!(decoded.is_some(), !input.is_empty());
    }
}

// ---- A connection's opening: its first bytes, the HTTP/2 preface and SETTINGS ----

fn http2_opening_bytes(settings: &[u8]) -> Vec<u8> {
    let mut bytes = CLIENT_PREFACE.to_vec();
    let len = (settings.len() as u32).to_be_bytes();
    bytes.extend_from_slice(&[len[1], len[2], len[3], FRAME_SETTINGS, 0, 0, 0, 0, 0]);
    bytes.extend_from_slice(settings);
    bytes
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn first_bytes_tell_a_protocol_without_panic(
        raw in prop_oneof![
            vec(any::<u8>(), 1..16),
            (0..=DIRECT_MAGIC.len(), vec(any::<u8>(), 0..8)).prop_map(|(cut, tail)| {
                let mut bytes = DIRECT_MAGIC[..cut].to_vec();
                bytes.extend(tail);
                bytes
            }),
        ],
    ) {
        prop_assume!(!raw.is_empty());
        let judged = first_bytes(&raw);
        prop_assert_eq!(judged == FirstBytes::Tls, raw[0] == TLS_HANDSHAKE_RECORD);
        if judged == FirstBytes::Direct {
            prop_assert!(raw.starts_with(DIRECT_MAGIC));
        }
        if judged == FirstBytes::NeedMore {
            prop_assert!(raw.len() < DIRECT_MAGIC.len() && DIRECT_MAGIC.starts_with(&raw));
        }
    }

    #[test]
    fn http2_openings_are_judged_without_panic(
        settings in vec(any::<u8>(), 0..64),
        changes in proptest::option::of(mutations()),
        raw in vec(any::<u8>(), 0..96),
        cut in 0usize..200,
    ) {
        let valid = http2_opening_bytes(&settings);
        let mutated = match &changes {
            Some(changes) => mutate(&valid, changes),
            None => valid.clone(),
        };
        for bytes in [&valid, &mutated, &raw] {
            let received = &bytes[..cut.min(bytes.len())];
            match http2_opening(received) {
                Http2Opening::Whole(end) => {
                    prop_assert!(end <= received.len() && end <= HTTP2_OPENING_MAX_BYTES);
                    prop_assert!(received.starts_with(CLIENT_PREFACE));
                    prop_assert_eq!(received[CLIENT_PREFACE.len() + 3], FRAME_SETTINGS);
                    // Every shorter prefix needs more, and no more than the whole.
                    for shorter in [0, end / 2, end - 1] {
                        match http2_opening(&received[..shorter]) {
                            Http2Opening::NeedBytes(n) => prop_assert!(n > shorter && n <= end),
                            other => prop_assert!(false, "{shorter}: {other:?}"),
                        }
                    }
                }
                Http2Opening::NeedBytes(n) => {
                    prop_assert!(n > received.len() && n <= HTTP2_OPENING_MAX_BYTES);
                }
                Http2Opening::NotHttp2 => {}
            }
        }
        let whole = http2_opening(&valid);
        if settings.len() % 6 == 0 {
            prop_assert_eq!(whole, Http2Opening::Whole(valid.len()));
        } else {
            prop_assert_eq!(whole, Http2Opening::NotHttp2);
        }
    }
}

// ---- IPC pieces of DoPut and DoGet ----

proptest! {
    #![proptest_config(config())]

    #[test]
    fn ipc_pieces_round_trip(value in vec(any::<u8>(), 0..256)) {
        let data = encode_piece(&value, Bytes::new());
        prop_assert!(!is_schema_message(&data.data_header));
        prop_assert_eq!(decode_piece(&data.data_header, &data.data_body).unwrap(), value);
    }

    #[test]
    fn ipc_pieces_refuse_without_panic(
        value in vec(any::<u8>(), 0..64),
        header_changes in proptest::option::of(mutations()),
        body_changes in proptest::option::of(mutations()),
        schema_changes in mutations(),
        raw in vec(any::<u8>(), 0..128),
    ) {
        let data = encode_piece(&value, Bytes::new());
        let header = match &header_changes {
            Some(changes) => mutate(&data.data_header, changes),
            None => data.data_header.to_vec(),
        };
        let body = match &body_changes {
            Some(changes) => Bytes::from(mutate(&data.data_body, changes)),
            None => data.data_body.clone(),
        };
        if let Ok(piece) = decode_piece(&header, &body) {
            prop_assert!(piece.len() <= body.len());
        }
        let _ = is_schema_message(&header);
        let _ = check_schema(&header);
        let schema = pocketflow_protocol::ipc::schema_flight_data().data_header;
        prop_assert!(check_schema(&schema).is_ok());
        let _ = check_schema(&mutate(&schema, &schema_changes));
        let _ = decode_piece(&raw, &Bytes::from(raw.clone()));
        let _ = check_schema(&raw);
        let _ = is_schema_message(&raw);
    }
}

// ---- JSON: tickets, descriptors, action bodies ----

fn context() -> BoxedStrategy<Context> {
    (name(JOB_ID_MAX_BYTES), any::<u64>(), "\\PC{0,90}")
        .prop_map(|(job, epoch, token)| Context { job, epoch, token })
        .boxed()
}

fn prefix() -> BoxedStrategy<String> {
    prop_oneof![Just(String::new()), name(KEY_MAX_BYTES)].boxed()
}

/// A JSON value without floats (serde_json does not promise to read floats back bit for bit).
fn exact_json() -> BoxedStrategy<Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        "\\PC{0,8}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::Array),
            vec(("[a-z]{1,4}", inner), 0..4)
                .prop_map(|pairs| Value::Object(pairs.into_iter().collect())),
        ]
    })
    .boxed()
}

/// Serialize, parse and compare.
fn json_round_trip<T>(value: &T, parse: fn(&[u8]) -> Result<T, ProtocolError>)
where
    T: serde::Serialize + PartialEq + std::fmt::Debug,
{
    let body = serde_json::to_vec(value).expect("JSON serializes");
    assert_eq!(&parse(&body).expect("a valid request parses"), value);
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn tickets_and_descriptors_round_trip(
        ctx in context(),
        bucket in name(BUCKET_NAME_MAX_BYTES),
        key in name(KEY_MAX_BYTES),
        version in 1..=u64::MAX,
        block_size in prop_oneof![Just(1), Just(BLOCK_SIZE_MAX_BYTES), 1..=BLOCK_SIZE_MAX_BYTES],
        persist in any::<bool>(),
        ranges in prop_oneof![
            20 => vec((1..=u32::MAX, 0..=u64::from(BLOCK_SIZE_MAX_BYTES))
                .prop_flat_map(|(index, offset)| {
                    (Just(index), Just(offset), 0..=u64::from(BLOCK_SIZE_MAX_BYTES) - offset)
                }), 1..6),
            1 => Just(vec![(1u32, 0u64, 1u64); TICKET_RANGES_MAX]),
        ],
    ) {
        let ranges = ranges
            .into_iter()
            .map(|(index, offset, len)| pocketflow_protocol::ticket::BlockRange(index, offset, len))
            .collect();
        let ticket = GetTicket {
            ctx: ctx.clone(), bucket: bucket.clone(), key: key.clone(), version, ranges, delete: persist,
        };
        json_round_trip(&ticket, GetTicket::parse);
        let read = ReadTicket {
            ctx: ctx.clone(), bucket: bucket.clone(), key: key.clone(), delete: persist,
            claim_whole: version % 2 == 0, inline_bytes_max: version,
        };
        json_round_trip(&read, ReadTicket::parse);
        let put = PutDescriptor { ctx: ctx.clone(), bucket, key, version, block_size, persist, commit: None };
        json_round_trip(&put, PutDescriptor::parse);
        json_round_trip(&ExchangeDescriptor { ctx }, ExchangeDescriptor::parse);
    }

    #[test]
    fn action_bodies_round_trip(
        ctx in context(),
        bucket in name(BUCKET_NAME_MAX_BYTES),
        key in name(KEY_MAX_BYTES),
        (version, blocks) in (proptest::option::of(1..=u64::MAX), vec(1..=u32::MAX, 0..6)),
        (prefix, start_after, limit) in
            (prefix(), proptest::option::of(prefix()), 1..=ENUMERATE_LIMIT_MAX),
        (job, epoch, map) in
            (proptest::option::of(name(JOB_ID_MAX_BYTES)), 1..=u64::MAX, exact_json()),
        (flag, cores) in (any::<bool>(), 1..=u32::MAX),
        keys in prop_oneof![
            20 => vec(name(KEY_MAX_BYTES), 1..6),
            1 => Just((0..WAIT_KEYS_MAX).map(|i| format!("k{i}")).collect()),
        ],
        timeout_ms in 0..=WAIT_TIMEOUT_MAX_MS,
    ) {
        let object = ObjectRequest { ctx: ctx.clone(), bucket: bucket.clone(), key: key.clone(), version };
        json_round_trip(&object, ObjectRequest::parse);
        let blocks = DeleteBlocksRequest {
            ctx: ctx.clone(), bucket: bucket.clone(), key, version: epoch, blocks,
        };
        json_round_trip(&blocks, DeleteBlocksRequest::parse);
        let enumerate = EnumerateRequest {
            ctx: ctx.clone(), bucket: bucket.clone(), prefix: prefix.clone(), start_after, limit,
        };
        json_round_trip(&enumerate, EnumerateRequest::parse);
        json_round_trip(&BucketRequest { ctx: ctx.clone(), bucket: bucket.clone() }, BucketRequest::parse);
        let by_prefix = PrefixRequest { ctx: ctx.clone(), bucket: bucket.clone(), prefix };
        json_round_trip(&by_prefix, PrefixRequest::parse);
        json_round_trip(&DeleteJobRequest { ctx: ctx.clone(), job: job.clone(), persist: false }, DeleteJobRequest::parse);
        let set_epoch = SetEpochRequest {
            ctx: ctx.clone(), job: job.unwrap_or_else(|| "j".into()), epoch, map,
        };
        json_round_trip(&set_epoch, SetEpochRequest::parse);
        prop_assert_eq!(set_epoch.map_json().unwrap(), set_epoch.map.to_string());
        json_round_trip(&DrainRequest { ctx: ctx.clone(), exit_when_empty: flag }, DrainRequest::parse);
        json_round_trip(&SetCoresRequest { ctx: ctx.clone(), cores }, SetCoresRequest::parse);
        json_round_trip(&WaitRequest { ctx, bucket, keys, timeout_ms }, WaitRequest::parse);
    }

    /// Every action's decoder, fed JSON objects of plausible and implausible fields, mutated JSON
    /// and raw bytes: it refuses with a typed error, or what it accepted has every required field
    /// and keeps every bound.
    #[test]
    fn action_bodies_refuse_or_keep_their_rules((object, body) in json_input()) {
        for action in ActionName::ALL {
            if checked(parse_action(action, &body)).is_some() {
                assert_present(object.as_ref(), required_fields(action), action.as_str());
            }
        }
    }

    #[test]
    fn tickets_and_descriptors_refuse_or_keep_their_rules((object, body) in json_input()) {
        if let Some(ticket) = checked(GetTicket::parse(&body)) {
            assert_ticket(&ticket);
            assert_present(object.as_ref(), &["ctx", "bucket", "key", "version", "ranges"], "ticket");
        }
        if let Some(read) = checked(ReadTicket::parse(&body)) {
            assert_job(&read.ctx.job);
            assert_present(object.as_ref(), &["ctx", "bucket", "key"], "read ticket");
        }
        if let Some(descriptor) = checked(PutDescriptor::parse(&body)) {
            assert_put_descriptor(&descriptor);
            assert_present(
                object.as_ref(),
                &["ctx", "bucket", "key", "version", "block_size"],
                "put descriptor",
            );
        }
        if let Some(descriptor) = checked(ExchangeDescriptor::parse(&body)) {
            assert_job(&descriptor.ctx.job);
            assert_present(object.as_ref(), &["ctx"], "exchange descriptor");
        }
    }

    #[test]
    fn action_names(name in prop_oneof![
        select(ActionName::ALL.to_vec()).prop_map(|action| action.as_str().to_owned()),
        text_near_bounds(),
        any::<String>(),
    ]) {
        if let Some(action) = checked(ActionName::from_name(&name)) {
            prop_assert_eq!(action.as_str(), name);
        }
    }
}

// ---- Capability tokens ----

const SECRET: &[u8] = b"fuzz-secret-0123456789";

proptest! {
    #![proptest_config(config())]

    #[test]
    fn tokens(
        job in name(JOB_ID_MAX_BYTES),
        expiry_unix_ms in 1..=u64::MAX,
        other_job in name(JOB_ID_MAX_BYTES),
        changes in mutations(),
        forged in prop_oneof![token_text(), any::<String>()],
    ) {
        let key = TokenKey::new(SECRET).unwrap();
        let token = key.make(&job, expiry_unix_ms);
        prop_assert_eq!(key.verify(&job, &token, expiry_unix_ms - 1), Ok(expiry_unix_ms));
        prop_assert!(
            matches!(key.verify(&job, &token, expiry_unix_ms), Err(TokenError::Expired { .. })),
            "expired token accepted"
        );
        if other_job != job {
            prop_assert_eq!(
                key.verify(&other_job, &token, 0),
                Err(TokenError::Mismatch(other_job.clone()))
            );
        }
        let mutated = String::from_utf8_lossy(&mutate(token.as_bytes(), &changes)).into_owned();
        if let Ok(expiry) = key.verify(&job, &mutated, 0) {
            // Hex digits are read in either case; nothing else about the token may change.
            prop_assert!(mutated.eq_ignore_ascii_case(&token), "{mutated} accepted for {token}");
            prop_assert_eq!(expiry, expiry_unix_ms);
        }
        let refused = key.verify(&job, &forged, 0);
        prop_assert!(refused.is_err(), "forged token {forged:?} accepted");
        check_refusal(&ProtocolError::Token(refused.unwrap_err()));
    }
}
