//! The data path of queues and append files: small ops on the server that placement picks for one
//! segment of a channel (block `segment` of the channel's name), pipelined over one session, with
//! the stale-map adoption and the bucket repair of every write. [`Objects::run_placed`] holds that
//! logic once; a single op ([`Objects::call_placed`]) is its one-op case.
//!
//! A segment is placed with the weight map in use; a `stale_epoch` answer (a session refused at
//! opening, or ops refused in a frame) brings a newer map, which is adopted, and the refused ops
//! run again where it places the segment. A server added to the job after the bucket was made
//! answers `bucket_not_found`: the bucket is created there once, as a put does, and those ops run
//! again. Ops that were answered otherwise keep their answers and never run twice, so an append
//! that landed is not appended again because another op of its batch was refused.

use std::borrow::Cow;

use pocketflow_protocol::limits::FRAME_OPS_MAX;

use crate::connection::{ExchangeReply, ExchangeRequest};
use crate::error::ClientError;
use crate::failure::{failure_reply, reply_error, Failure};
use crate::homes::home;
use crate::objects::{Objects, STALE_EPOCH_RETRIES_MAX};
use crate::writes::kind_is;

/// Most ops one [`Objects::run_placed`] runs: one request frame's worth (`FRAME_OPS_MAX`). A
/// caller with more splits them into runs of its own (`append_many` sends at most 256 a round).
pub const PLACED_OPS_MAX: usize = FRAME_OPS_MAX as usize;

/// Whether `count` ops fit one placed run; the error says why not. The Python binding asks
/// before it converts a long list of ops.
pub fn check_placed_ops(count: usize) -> Result<(), ClientError> {
    if count > PLACED_OPS_MAX {
        return Err(ClientError::InvalidArgument(format!(
            "{count} ops in one placed run; at most {PLACED_OPS_MAX}"
        )));
    }
    Ok(())
}

/// One op's answer from a placed run: the address of the server that answered it, and its reply
/// (whatever its status; the caller maps the ones it knows).
pub type PlacedReply = (String, ExchangeReply);

/// Whether `reply` asks for the op to run again once the map or the bucket is mended.
fn refused(reply: &ExchangeReply) -> bool {
    if reply.status == 0 {
        return false;
    }
    let error = reply_error(reply);
    error.is_stale_epoch() || kind_is(&error, "bucket_not_found")
}

impl Objects {
    /// Run one small op on the server of block `block` of `request.key` (see the module doc);
    /// returns the answering server's address and its reply.
    pub fn call_placed(
        &self,
        request: ExchangeRequest,
        block: u32,
    ) -> Result<PlacedReply, Failure> {
        let mut replies = self.run_placed(std::slice::from_ref(&request), block)?;
        Ok(replies.pop().expect("one reply per op"))
    }

    /// Run `requests`, ops on one bucket and key, pipelined over one session of the server of
    /// block `block` of that key, adopting newer maps and repairing the bucket (see the module
    /// doc); returns each op's answer in order. At most [`PLACED_OPS_MAX`] ops; a run past the
    /// last of `STALE_EPOCH_RETRIES_MAX` adoptions fails with its `stale_epoch` error.
    pub fn run_placed(
        &self,
        requests: &[ExchangeRequest],
        block: u32,
    ) -> Result<Vec<PlacedReply>, Failure> {
        let Some(first) = requests.first() else {
            return Ok(Vec::new());
        };
        check_placed_ops(requests.len()).map_err(Failure::local)?;
        if requests
            .iter()
            .any(|r| r.bucket != first.bucket || r.key != first.key)
        {
            return Err(Failure::local(ClientError::InvalidArgument(
                "the ops of one placed run are on one bucket and key".into(),
            )));
        }
        let mut replies: Vec<Option<PlacedReply>> = vec![None; requests.len()];
        let mut pending: Vec<usize> = (0..requests.len()).collect();
        let mut repaired = false;
        for attempt in 0..=STALE_EPOCH_RETRIES_MAX {
            let view = self.view();
            let server = home(&view, first.key.as_bytes(), block, false)?;
            // The first round sends the caller's ops as they are; a later one only the refused.
            let round: Cow<'_, [ExchangeRequest]> = if pending.len() == requests.len() {
                Cow::Borrowed(requests)
            } else {
                Cow::Owned(pending.iter().map(|&i| requests[i].clone()).collect())
            };
            // The whole round is one window: a channel's batch is sized to the session's
            // in-flight bound by its caller, and the session clamps it to that bound anyway.
            let outcome = self.connection(&server.address).and_then(|connection| {
                connection.exchange_blocking(
                    &view.exchange_command,
                    view.epoch,
                    &round,
                    round.len(),
                )
            });
            let answers = match outcome {
                Ok(answers) => answers,
                // A new session's opening context was stale: the session ran none of the ops.
                Err(error) if error.is_stale_epoch() => vec![failure_reply(&error); round.len()],
                Err(error) => return Err(Failure::at(error, &server.address)),
            };
            let mut stale: Option<ClientError> = None;
            let mut bucket_missing = false;
            for (&index, reply) in pending.iter().zip(answers) {
                if reply.status != 0 {
                    let error = reply_error(&reply);
                    if error.is_stale_epoch() {
                        stale.get_or_insert(error);
                    } else if kind_is(&error, "bucket_not_found") {
                        bucket_missing = true;
                    }
                }
                replies[index] = Some((server.address.clone(), reply));
            }
            let again = if let Some(error) = stale {
                self.adopt_or_fail(Failure::at(error, &server.address), attempt)?;
                true
            } else if bucket_missing && !repaired && attempt < STALE_EPOCH_RETRIES_MAX {
                repaired = true;
                self.repair_bucket(&view, &first.bucket, &server.address)?
            } else {
                false
            };
            if !again {
                break;
            }
            pending.retain(|&index| {
                replies[index]
                    .as_ref()
                    .is_some_and(|(_, reply)| refused(reply))
            });
        }
        Ok(replies
            .into_iter()
            .map(|reply| reply.expect("every op was answered"))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn answer(status: u8, body: &'static str) -> ExchangeReply {
        ExchangeReply {
            status,
            header: None,
            body: Bytes::from_static(body.as_bytes()),
        }
    }

    #[test]
    fn only_stale_and_missing_bucket_answers_run_again() {
        assert!(refused(&answer(9, "stale_epoch: {\"epoch\":2}")));
        assert!(refused(&answer(5, "bucket_not_found: b")));
        assert!(!refused(&answer(0, "")));
        assert!(!refused(&answer(9, "sealed: segment 0")));
        assert!(!refused(&answer(8, "capacity_exhausted: full")));
    }

    #[test]
    fn the_bound_on_ops_is_checked_before_anything_runs() {
        assert!(check_placed_ops(PLACED_OPS_MAX).is_ok());
        let error = check_placed_ops(PLACED_OPS_MAX + 1).unwrap_err();
        assert_eq!(error.code(), tonic::Code::InvalidArgument as i32);
    }
}
