//! Garbage at every RPC: random tickets, descriptors, frames, app_metadata, IPC bytes and action
//! bodies (a bounded number of each); the server answers each with a status and keeps serving.

use std::time::Duration;

use arrow_flight::{Action, FlightData, FlightDescriptor, Ticket};
use bytes::Bytes;
use futures::StreamExt;
use pocketflow_protocol::action::ActionName;
use pocketflow_protocol::frame::{encode_request_frame, OpCode};
use serde_json::json;
use tonic::Code;

use crate::harness::*;

/// Cases per RPC kind.
const CASES: u64 = 60;

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn bytes(&mut self, max_len: u64) -> Bytes {
        let len = self.below(max_len + 1) as usize;
        (0..len)
            .map(|_| self.next() as u8)
            .collect::<Vec<u8>>()
            .into()
    }

    /// Mutate `valid` by flipping, truncating or extending it.
    fn mutate(&mut self, valid: &[u8]) -> Bytes {
        let mut out = valid.to_vec();
        match self.below(4) {
            0 => out.truncate(self.below(out.len() as u64 + 1) as usize),
            1 => out.extend_from_slice(&self.bytes(64)),
            _ => {
                for _ in 0..=self.below(8) {
                    if !out.is_empty() {
                        let at = self.below(out.len() as u64) as usize;
                        out[at] = self.next() as u8;
                    }
                }
            }
        }
        out.into()
    }

    fn garbage_or_mutation(&mut self, valid: &[u8]) -> Bytes {
        if self.below(3) == 0 {
            self.bytes(300)
        } else {
            self.mutate(valid)
        }
    }
}

/// Codes a garbage request may get; anything else (or a panic, or a dead server) fails the test.
fn acceptable(code: Code) -> bool {
    matches!(
        code,
        Code::InvalidArgument
            | Code::PermissionDenied
            | Code::NotFound
            | Code::FailedPrecondition
            | Code::AlreadyExists
            | Code::ResourceExhausted
            | Code::Ok
    )
}

#[tokio::test]
async fn garbage_at_every_rpc_is_refused_and_the_server_keeps_serving() {
    let server = TestServer::start(ServerOptions::default());
    let client = server.client().await;
    client.create_bucket("job-a", "b").await;
    let used_before = client.stats().await["used_bytes"]
        .as_u64()
        .expect("used_bytes");
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut inner = client.inner.clone();

    let valid_ticket = json!({"ctx": ctx("job-a", 1), "bucket": "b", "key": "k", "version": 1, "ranges": [[1, 0, 10]]})
        .to_string();
    for _ in 0..CASES {
        let ticket = rng.garbage_or_mutation(valid_ticket.as_bytes());
        let code = match inner.do_get(Ticket { ticket }).await {
            Ok(response) => {
                let mut stream = response.into_inner();
                let mut code = Code::Ok;
                while let Some(message) = stream.next().await {
                    if let Err(status) = message {
                        code = status.code();
                    }
                }
                code
            }
            Err(status) => status.code(),
        };
        assert!(acceptable(code), "DoGet garbage got {code:?}");
    }

    let valid_action = json!({"ctx": ctx("job-a", 1), "bucket": "b", "key": "k"}).to_string();
    // Every real action, plus names no action has.
    let names: Vec<&str> = ActionName::ALL
        .iter()
        .map(|name| name.as_str())
        .chain(["\u{0}", ""])
        .collect();
    for i in 0..CASES {
        let name = names[(i as usize) % names.len()];
        // `drain` with a valid admin body would stop writes; bodies here never carry the admin token.
        let body = rng.garbage_or_mutation(valid_action.as_bytes());
        let result = inner
            .do_action(Action {
                r#type: name.into(),
                body,
            })
            .await;
        if let Err(status) = result {
            assert!(
                acceptable(status.code()),
                "action {name} garbage got {status:?}"
            );
        }
        // A mutation may still be a valid delete_bucket or delete_job; keep the bucket around.
        let _ = client
            .action(
                "create_bucket",
                json!({"ctx": ctx("job-a", 1), "bucket": "b"}),
            )
            .await;
    }

    let valid_put = put_descriptor("job-a", "b", "g", 5, 1024, false).to_string();
    for _ in 0..CASES {
        let mut messages = put_messages(
            serde_json::from_str(&valid_put).unwrap(),
            &[(1, pattern(100, 1))],
            50,
        );
        match rng.below(4) {
            0 => {
                let cmd = rng.garbage_or_mutation(valid_put.as_bytes());
                messages[0].flight_descriptor = Some(FlightDescriptor::new_cmd(cmd));
            }
            1 => {
                let at = 1 + rng.below(messages.len() as u64 - 1) as usize;
                messages[at].app_metadata =
                    rng.garbage_or_mutation(&messages[at].app_metadata.clone());
            }
            2 => {
                let at = rng.below(messages.len() as u64) as usize;
                messages[at].data_header =
                    rng.garbage_or_mutation(&messages[at].data_header.clone());
            }
            _ => {
                let at = 1 + rng.below(messages.len() as u64 - 1) as usize;
                messages[at].data_body = rng.garbage_or_mutation(&messages[at].data_body.clone());
            }
        }
        let code = match inner.do_put(futures::stream::iter(messages)).await {
            Ok(response) => match response.into_inner().next().await {
                Some(Err(status)) => status.code(),
                _ => Code::Ok,
            },
            Err(status) => status.code(),
        };
        assert!(acceptable(code), "DoPut garbage got {code:?}");
        // Whatever got in is removed again, so later cases start from the same state.
        let _ = client.action("delete_blocks", json!({"ctx": ctx("job-a", 1), "bucket": "b", "key": "g", "version": 5, "blocks": [1]})).await;
    }

    let valid_exchange = json!({"ctx": ctx("job-a", 1)}).to_string();
    let valid_frame = encode_request_frame(
        1,
        &[
            put(1, "b", "x", pattern(20, 1), 0),
            simple(2, OpCode::Get, "b", "x", 0),
        ],
    );
    for _ in 0..CASES {
        let (descriptor, frame) = if rng.below(4) == 0 {
            (
                rng.garbage_or_mutation(valid_exchange.as_bytes()),
                valid_frame.clone(),
            )
        } else {
            (
                Bytes::from(valid_exchange.clone()),
                rng.garbage_or_mutation(&valid_frame),
            )
        };
        let first = FlightData {
            flight_descriptor: Some(FlightDescriptor::new_cmd(descriptor)),
            ..Default::default()
        };
        let second = FlightData {
            app_metadata: frame,
            ..Default::default()
        };
        let code = match inner
            .do_exchange(futures::stream::iter(vec![first, second]))
            .await
        {
            Ok(response) => {
                let mut stream = response.into_inner();
                let mut code = Code::Ok;
                // The request stream is complete, so the session must end: a hang is a failure.
                loop {
                    match tokio::time::timeout(Duration::from_secs(5), stream.next()).await {
                        Ok(Some(Err(status))) => code = status.code(),
                        Ok(Some(Ok(_))) => {}
                        Ok(None) => break,
                        Err(_) => panic!("a DoExchange of garbage hung for 5 s"),
                    }
                }
                code
            }
            Err(status) => status.code(),
        };
        assert!(acceptable(code), "DoExchange garbage got {code:?}");
        let _ = client
            .action(
                "delete",
                json!({"ctx": ctx("job-a", 1), "bucket": "b", "key": "x"}),
            )
            .await;
    }

    // Still serving, nothing leaked into the store.
    let mut session = client.session("job-a", 1).await.unwrap();
    let replies = session
        .run(
            1,
            &[
                put(1, "b", "after", pattern(10, 1), 0),
                simple(2, OpCode::Get, "b", "after", 0),
            ],
        )
        .await;
    assert!(replies.values().all(|r| r.status == 0) || replies[&2].status == 5);
    let replies = session
        .run(1, &[simple(3, OpCode::Get, "b", "after", 0)])
        .await;
    assert_eq!(replies[&3].body, pattern(10, 1));
    assert!(server.memory_bytes().0 > 0);
    // Nothing the garbage got in stayed: only the one object written after it is counted.
    let deleted = client
        .action(
            "delete",
            json!({"ctx": ctx("job-a", 1), "bucket": "b", "key": "after"}),
        )
        .await;
    assert!(deleted.is_ok(), "{deleted:?}");
    let used_after = client.stats().await["used_bytes"]
        .as_u64()
        .expect("used_bytes");
    assert_eq!(used_after, used_before, "garbage left bytes behind");
}
