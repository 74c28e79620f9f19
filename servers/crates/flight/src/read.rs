//! The direct READ (`Kind::Read`): an object's block-0 record and its bytes in one exchange with
//! the record's server. A small object's value, or the data block of an object of one data
//! block (kept on its manifest's server), follows the record on the same connection, so a get
//! of either costs one round trip instead of a record lookup and then a block read.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use pocketflow_protocol::direct::{encode_head, Kind, DATA_META_BYTES, MESSAGE_HEAD_BYTES};
use pocketflow_protocol::frame::{Reply, ReplyFrameBuilder, STATUS_OK};
use pocketflow_protocol::ticket::{BlockRange, GetTicket, ReadTicket};
use pocketflow_protocol::ObjectHeader;
use pocketflow_store::Claim;
use tokio::io::{AsyncWrite, AsyncWriteExt};

use crate::auth::KeptToken;
use crate::doget;
use crate::service::ServiceState;
use crate::status::ServiceError;

/// The answer to one READ, as the client receives it: the record's reply, then (when OK) the
/// object's bytes, then END. `Err(Some)` is an error of the request itself (malformed ticket,
/// bad token), answered with a STATUS that ends the connection; `Err(None)`: the client went
/// away.
///
/// `kept` is the last token the connection verified (see `Authority::job_kept`).
pub(crate) async fn send_read<W>(
    state: Arc<ServiceState>,
    ticket_bytes: &[u8],
    writer: &mut W,
    kept: &mut Option<KeptToken>,
) -> Result<(), Option<ServiceError>>
where
    W: AsyncWrite + Unpin,
{
    let started = Instant::now();
    let sent = answer(state.clone(), ticket_bytes, writer, kept).await;
    let kind = match &sent {
        Ok(Ok(())) => "ok",
        Ok(Err(e)) | Err(Some(e)) => e.kind().as_str(),
        Err(None) => "unavailable",
    };
    state
        .metrics
        .request("direct_read", "get", kind, started.elapsed());
    sent.map(|_| ())
}

/// Send the answer; `Ok(Err)` when it was the record's error (a reply: the connection stays).
async fn answer<W>(
    state: Arc<ServiceState>,
    ticket_bytes: &[u8],
    writer: &mut W,
    kept: &mut Option<KeptToken>,
) -> Result<Result<(), ServiceError>, Option<ServiceError>>
where
    W: AsyncWrite + Unpin,
{
    let ticket = ReadTicket::parse(ticket_bytes).map_err(|e| Some(e.into()))?;
    state.stats.counters.add_ops(1);
    let idle = state.transfer_idle;
    // A stale epoch is the record's answer, as for an exchange GET: the client adopts the new
    // map and asks again on the same connection. Any other refusal of the context ends it.
    let job = match state.auth.job_kept(&ticket.ctx, kept) {
        Ok(job) => job,
        Err(e @ ServiceError::StaleEpoch { .. }) => {
            send_reply(writer, idle, &error_reply(&e), &[]).await?;
            return Ok(Err(e));
        }
        Err(e) => return Err(Some(e)),
    };
    let claim = match (ticket.delete, ticket.claim_whole) {
        (false, _) => Claim::Never,
        (true, false) => Claim::Always,
        (true, true) => Claim::Whole {
            inline_bytes_max: ticket.inline_bytes_max,
        },
    };
    let record = state
        .store
        .get_record_claiming(&job, &ticket.bucket, &ticket.key, claim)
        .await;
    let (header, value, claimed) = match record {
        Ok(found) => found,
        Err(e) => {
            let e = ServiceError::from(e);
            send_reply(writer, idle, &error_reply(&e), &[]).await?;
            return Ok(Err(e));
        }
    };
    if header.block_count == 0 {
        state.stats.counters.add_out(value.len() as u64);
        send_reply(writer, idle, &ok_reply(header, Bytes::new()), &value).await?;
        return Ok(Ok(()));
    }
    // A manifest's value (an overflowed one names the servers its blocks skipped) is the
    // reply's body, as in an exchange GET; object bytes come as DATA only.
    let reply = ok_reply(header, value);
    if block_follows(&state, &job, &ticket, &header)? {
        let block = GetTicket {
            ctx: ticket.ctx,
            bucket: ticket.bucket,
            key: ticket.key,
            version: header.version,
            ranges: vec![BlockRange(1, 0, header.size)],
            // The block goes with the record it belongs to: freed only if the record was taken.
            delete: claimed,
        };
        let prefix = reply_message(&reply);
        doget::send_direct_authorized(state, job, block, writer, &prefix).await?;
        return Ok(Ok(()));
    }
    // A manifest alone: the reader fetches the data blocks as for any large object.
    send_reply(writer, idle, &reply, &[]).await?;
    Ok(Ok(()))
}

/// Whether the one data block of the object of `header` goes with its record: the reader has
/// room for it and this server holds it whole (a writer that placed it elsewhere, or under an
/// earlier map, left it to the reader's usual block read).
fn block_follows(
    state: &ServiceState,
    job: &str,
    ticket: &ReadTicket,
    header: &ObjectHeader,
) -> Result<bool, Option<ServiceError>> {
    if header.block_count != 1 || header.size > ticket.inline_bytes_max {
        return Ok(false);
    }
    let held = state
        .store
        .block_len(job, &ticket.bucket, &ticket.key, header.version, 1)
        .map_err(|e| Some(e.into()))?;
    Ok(held == Some(header.size))
}

fn ok_reply(header: ObjectHeader, body: Bytes) -> Reply {
    Reply {
        request_id: 0,
        status: STATUS_OK,
        header: Some(header),
        body,
    }
}

fn error_reply(e: &ServiceError) -> Reply {
    Reply {
        request_id: 0,
        status: e.status_byte(),
        header: None,
        body: e.reply_body(),
    }
}

/// The FRAME message holding `reply` alone.
fn reply_message(reply: &Reply) -> Vec<u8> {
    let mut builder = ReplyFrameBuilder::new();
    builder.push(reply);
    let frame = builder.finish();
    let mut message = Vec::with_capacity(MESSAGE_HEAD_BYTES + frame.len());
    message.extend_from_slice(&encode_head(Kind::Frame, frame.len()));
    message.extend_from_slice(&frame);
    message
}

/// Send `reply`, then `value` (a small object's bytes: one DATA message of block 0, when not
/// empty), then END, in one write.
/// A client that takes none of it for `idle` ends the connection, as a stalled GET does.
async fn send_reply<W>(
    writer: &mut W,
    idle: Duration,
    reply: &Reply,
    value: &[u8],
) -> Result<(), Option<ServiceError>>
where
    W: AsyncWrite + Unpin,
{
    let mut head = reply_message(reply);
    if !value.is_empty() {
        head.extend_from_slice(&encode_head(Kind::Data, DATA_META_BYTES + value.len()));
        head.extend_from_slice(&0u32.to_le_bytes());
        head.extend_from_slice(&0u64.to_le_bytes());
    }
    let end = encode_head(Kind::End, 0);
    let mut message = (&head[..]).chain(value).chain(&end[..]);
    let sent = async {
        writer.write_all_buf(&mut message).await?;
        writer.flush().await
    };
    match tokio::time::timeout(idle, sent).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(None),
        Err(_) => Err(Some(ServiceError::TransferIdle {
            transfer: "direct READ",
            idle_ms: idle.as_millis() as u64,
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doget::tests::{put_block, state_over, JOB};
    use pocketflow_protocol::direct::decode_head;
    use pocketflow_protocol::frame::decode_reply_frame;
    use pocketflow_protocol::token::{now_unix_ms, TokenKey};
    use pocketflow_store::engine::dram::DramEngine;
    use pocketflow_store::Store;

    /// A store holding `b/small` (5 bytes), `b/one` (an object of one 10-byte data block,
    /// version 7, its block here) and `b/two` (two data blocks of 10, version 8, none here).
    async fn state() -> (Arc<ServiceState>, TokenKey) {
        let engine = Arc::new(DramEngine::open(1 << 20, false).unwrap());
        let store = Store::with_engine(engine, false);
        store.create_bucket(JOB, "b").unwrap();
        let small = ObjectHeader {
            version: 3,
            size: 5,
            ..Default::default()
        };
        store
            .put_record(
                JOB,
                "b",
                "small",
                small,
                Bytes::from_static(b"hello"),
                false,
            )
            .await
            .unwrap();
        let manifest = |version, size| ObjectHeader {
            version,
            size,
            block_count: size.div_ceil(10) as u32,
            block_size: 10,
            flags: 0,
        };
        put_block(&store, 1, Bytes::from(vec![1u8; 10])).await; // b/k version 7
        store
            .put_record(JOB, "b", "k", manifest(7, 10), Bytes::new(), false)
            .await
            .unwrap();
        store
            .put_record(JOB, "b", "two", manifest(8, 20), Bytes::new(), false)
            .await
            .unwrap();
        state_over(store)
    }

    fn ticket(key: &TokenKey, object: &str, delete: bool, inline_bytes_max: u64) -> Vec<u8> {
        let token = key.make(JOB, now_unix_ms() + 60_000);
        format!(
            r#"{{"ctx":{{"job":"{JOB}","epoch":1,"token":"{token}"}},"bucket":"b","key":"{object}","delete":{delete},"inline_bytes_max":{inline_bytes_max}}}"#
        )
        .into_bytes()
    }

    /// The answer's reply, and its DATA messages as (block index, offset, bytes).
    fn parse(answer: &[u8]) -> (Reply, Vec<(u32, u64, Vec<u8>)>) {
        let head: [u8; MESSAGE_HEAD_BYTES] = answer[..MESSAGE_HEAD_BYTES].try_into().unwrap();
        let (kind, len) = decode_head(&head).unwrap();
        assert_eq!(kind, Kind::Frame);
        let frame = Bytes::copy_from_slice(&answer[MESSAGE_HEAD_BYTES..MESSAGE_HEAD_BYTES + len]);
        let mut replies = decode_reply_frame(&frame).unwrap();
        assert_eq!(replies.len(), 1);
        let rest = &answer[MESSAGE_HEAD_BYTES + len..];
        (
            replies.pop().unwrap(),
            crate::doget::tests::data_messages(rest),
        )
    }

    async fn read(state: &Arc<ServiceState>, ticket: &[u8]) -> (Reply, Vec<(u32, u64, Vec<u8>)>) {
        let mut answer = Vec::new();
        send_read(state.clone(), ticket, &mut answer, &mut None)
            .await
            .unwrap();
        parse(&answer)
    }

    #[tokio::test]
    async fn a_small_object_comes_with_its_record() {
        let (state, key) = state().await;
        let (reply, data) = read(&state, &ticket(&key, "small", false, 0)).await;
        assert_eq!(reply.status, STATUS_OK);
        assert_eq!(reply.header.unwrap().size, 5);
        assert_eq!(data, vec![(0, 0, b"hello".to_vec())]);
        // DELETE on read claims it: a second read finds nothing, and the connection goes on.
        let (_, data) = read(&state, &ticket(&key, "small", true, 0)).await;
        assert_eq!(data.len(), 1);
        let (reply, data) = read(&state, &ticket(&key, "small", true, 0)).await;
        assert_eq!(reply.status, ServiceError::from(not_found()).status_byte());
        assert!(String::from_utf8_lossy(&reply.body).starts_with("not_found: "));
        assert!(data.is_empty());
    }

    fn not_found() -> pocketflow_store::StoreError {
        pocketflow_store::StoreError::NotFound {
            bucket: "b".into(),
            key: "small".into(),
        }
    }

    #[tokio::test]
    async fn the_one_data_block_comes_with_its_manifest_when_the_reader_has_room() {
        let (state, key) = state().await;
        let (reply, data) = read(&state, &ticket(&key, "k", false, 10)).await;
        assert_eq!(reply.header.unwrap().block_count, 1);
        assert_eq!(data, vec![(1, 0, vec![1u8; 10])]);
        // No room: the manifest alone, and the block stays.
        let (reply, data) = read(&state, &ticket(&key, "k", false, 9)).await;
        assert_eq!(reply.header.unwrap().version, 7);
        assert!(data.is_empty());
        // A manifest of two blocks never brings them.
        let (reply, data) = read(&state, &ticket(&key, "two", false, 1 << 20)).await;
        assert_eq!(reply.header.unwrap().block_count, 2);
        assert!(data.is_empty());
        // DELETE on read frees the record and the block it sent.
        let (_, data) = read(&state, &ticket(&key, "k", true, 10)).await;
        assert_eq!(data.len(), 1);
        drop(data);
        assert_eq!(state.store.block_len(JOB, "b", "k", 7, 1).unwrap(), None);
        assert_eq!(state.transfers.available_permits(), 1);
    }

    #[tokio::test]
    async fn a_block_kept_elsewhere_is_left_to_the_reader() {
        let (state, key) = state().await;
        state.store.delete_blocks(JOB, "b", "k", 7, &[1]).unwrap();
        let (reply, data) = read(&state, &ticket(&key, "k", true, 10)).await;
        assert_eq!(reply.status, STATUS_OK);
        assert_eq!(reply.header.unwrap().block_count, 1);
        assert!(data.is_empty());
        assert!(
            state.store.lookup(JOB, "b", "k").is_err(),
            "the record was claimed"
        );
    }

    #[tokio::test]
    async fn an_overflowed_manifest_comes_with_the_servers_its_blocks_skipped() {
        let (state, key) = state().await;
        let overflowed = ObjectHeader {
            version: 9,
            size: 10,
            block_count: 1,
            block_size: 10,
            flags: pocketflow_protocol::HEADER_FLAG_OVERFLOW,
        };
        let skipped = Bytes::from_static(br#"["dram-0"]"#);
        state
            .store
            .put_record(JOB, "b", "moved", overflowed, skipped.clone(), false)
            .await
            .unwrap();
        // Its block is on another server: the manifest alone, its value in the reply's body.
        let (reply, data) = read(&state, &ticket(&key, "moved", true, 1 << 20)).await;
        assert_eq!(reply.status, STATUS_OK);
        assert!(reply.header.unwrap().overflowed());
        assert_eq!(reply.body, skipped);
        assert!(data.is_empty());
        // A plain manifest's body stays empty, and a small object's bytes come as DATA only.
        let (reply, _) = read(&state, &ticket(&key, "two", false, 0)).await;
        assert!(reply.body.is_empty());
        let (reply, data) = read(&state, &ticket(&key, "small", false, 0)).await;
        assert!(reply.body.is_empty() && data.len() == 1);
    }

    #[tokio::test]
    async fn a_stale_epoch_is_the_records_answer_and_a_bad_token_ends_the_connection() {
        let (state, key) = state().await;
        state
            .auth
            .set_epoch(JOB, 2, r#"{"epoch":2}"#.into())
            .unwrap();
        let (reply, data) = read(&state, &ticket(&key, "small", false, 0)).await;
        assert_eq!(
            reply.status,
            pocketflow_protocol::ErrorKind::StaleEpoch.grpc_code()
        );
        assert!(String::from_utf8_lossy(&reply.body).contains(r#"{"epoch":2}"#));
        assert!(data.is_empty());
        let forged = String::from_utf8(ticket(&key, "small", false, 0))
            .unwrap()
            .replace(r#""epoch":1,"token":""#, r#""epoch":2,"token":"1"#);
        let mut answer = Vec::new();
        let refused = send_read(state.clone(), forged.as_bytes(), &mut answer, &mut None).await;
        assert_eq!(
            refused.err().flatten().unwrap().kind(),
            pocketflow_protocol::ErrorKind::PermissionDenied
        );
        assert!(answer.is_empty());
        let mut answer = Vec::new();
        let malformed = send_read(state.clone(), b"{}", &mut answer, &mut None).await;
        assert_eq!(
            malformed.err().flatten().unwrap().kind(),
            pocketflow_protocol::ErrorKind::InvalidArgument
        );
    }
}
