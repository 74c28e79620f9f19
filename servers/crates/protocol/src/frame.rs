//! DoExchange request and reply frames: the byte layouts of docs/PROTOCOL.md, decoded without
//! copying values.

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::ProtocolError;
use crate::header::{ObjectHeader, HEADER_LEN_BYTES};
use crate::limits::{
    BUCKET_NAME_MAX_BYTES, FRAME_MAX_BYTES, FRAME_OPS_MAX, FRAME_VERSION, KEY_MAX_BYTES,
    SMALL_OBJECT_MAX_BYTES,
};

/// Bytes of a request frame before its first op.
pub const REQUEST_FRAME_HEAD_BYTES: usize = 16;
/// Bytes of a request op before its bucket name.
pub const REQUEST_OP_HEAD_BYTES: usize = 52;
/// Bytes of a reply frame before its first reply.
pub const REPLY_FRAME_HEAD_BYTES: usize = 8;
/// Bytes of a reply before its optional header.
pub const REPLY_HEAD_BYTES: usize = 16;
/// Buffer a [`ReplyFrameBuilder::new`] frame starts with.
pub const REPLY_FRAME_CAPACITY_DEFAULT_BYTES: usize = 4096;
/// Most replies the server puts in one reply frame.
pub const REPLY_FRAME_REPLIES_MAX: u32 = FRAME_OPS_MAX;

/// Op flag of GET: remove the object as part of the read.
pub const OP_FLAG_DELETE: u8 = 1;
/// Op flag of PUT: the object is PERSIST.
pub const OP_FLAG_PERSIST: u8 = 2;
/// Op flag of PUT: replace an existing object.
pub const OP_FLAG_OVERWRITE: u8 = 4;
/// Op flag of QUEUE_INFO and APPEND_INFO: seal the segment (creating it sealed if absent).
pub const OP_FLAG_SEAL: u8 = 8;
/// Op flag of GET with `OP_FLAG_DELETE`: claim the record only if it is a small object's (its
/// bytes come with the reply); a striped object's manifest stays, and its reader removes it
/// after reading the blocks, with a `delete` action conditional on the version.
pub const OP_FLAG_CLAIM_WHOLE: u8 = 16;
/// Reply flag: a 32-byte object header follows the fixed part.
pub const REPLY_FLAG_HEADER: u8 = 1;
/// Reply status byte of success.
pub const STATUS_OK: u8 = 0;

/// The operation of one request op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpCode {
    /// Store block 0 (a small object or a manifest).
    Put,
    /// Read block 0.
    Get,
    /// Remove block 0 and return its header.
    Delete,
    /// Return block 0's header.
    Lookup,
    /// Add an item at the tail of a queue segment.
    Enqueue,
    /// Take the item at the head of a queue segment.
    Dequeue,
    /// A queue segment's length, bound and seal; seals it with `OP_FLAG_SEAL`.
    QueueInfo,
    /// Append one record to an append-file segment.
    Append,
    /// Read bytes of an append-file segment by offset.
    ReadAppend,
    /// Read whole records of an append-file segment from a record index.
    ReadRecords,
    /// Hold an object's bytes in the server's shared arena for the calling process: the reply
    /// says where they are (a [`crate::pin::PinGrant`]), or carries a small object's value.
    Pin,
    /// Release a pin taken by [`OpCode::Pin`].
    Unpin,
}

impl OpCode {
    /// The op's code byte.
    pub fn code(self) -> u8 {
        match self {
            OpCode::Put => 1,
            OpCode::Get => 2,
            OpCode::Delete => 3,
            OpCode::Lookup => 4,
            OpCode::Enqueue => 5,
            OpCode::Dequeue => 6,
            OpCode::QueueInfo => 7,
            OpCode::Append => 8,
            OpCode::ReadAppend => 9,
            OpCode::ReadRecords => 10,
            OpCode::Pin => 11,
            OpCode::Unpin => 12,
        }
    }

    /// The op named by a code byte.
    pub fn from_code(code: u8) -> Result<Self, ProtocolError> {
        match code {
            1 => Ok(OpCode::Put),
            2 => Ok(OpCode::Get),
            3 => Ok(OpCode::Delete),
            4 => Ok(OpCode::Lookup),
            5 => Ok(OpCode::Enqueue),
            6 => Ok(OpCode::Dequeue),
            7 => Ok(OpCode::QueueInfo),
            8 => Ok(OpCode::Append),
            9 => Ok(OpCode::ReadAppend),
            10 => Ok(OpCode::ReadRecords),
            11 => Ok(OpCode::Pin),
            12 => Ok(OpCode::Unpin),
            other => Err(ProtocolError::OpCode(other)),
        }
    }

    /// Lower-case name for messages.
    pub fn name(self) -> &'static str {
        match self {
            OpCode::Put => "put",
            OpCode::Get => "get",
            OpCode::Delete => "delete",
            OpCode::Lookup => "lookup",
            OpCode::Enqueue => "enqueue",
            OpCode::Dequeue => "dequeue",
            OpCode::QueueInfo => "queue_info",
            OpCode::Append => "append",
            OpCode::ReadAppend => "read_append",
            OpCode::ReadRecords => "read_records",
            OpCode::Pin => "pin",
            OpCode::Unpin => "unpin",
        }
    }

    fn allowed_flags(self) -> u8 {
        match self {
            OpCode::Put => OP_FLAG_PERSIST | OP_FLAG_OVERWRITE,
            OpCode::Get => OP_FLAG_DELETE | OP_FLAG_CLAIM_WHOLE,
            OpCode::QueueInfo | OpCode::ReadAppend => OP_FLAG_SEAL,
            _ => 0,
        }
    }

    /// Whether the op's 32 header bytes are an [`ObjectHeader`] (PUT) or channel arguments
    /// (queue and append ops); every other op sends zeros.
    pub fn takes_header(self) -> bool {
        !matches!(self, OpCode::Get | OpCode::Delete | OpCode::Lookup)
    }

    /// Whether the op carries a value (PUT, ENQUEUE, APPEND).
    pub fn takes_value(self) -> bool {
        matches!(self, OpCode::Put | OpCode::Enqueue | OpCode::Append)
    }

    /// Whether the op is a queue or append-file op (its header is [`ChannelArgs`]).
    pub fn is_channel(self) -> bool {
        self.takes_header() && !matches!(self, OpCode::Put | OpCode::Pin | OpCode::Unpin)
    }
}

/// The arguments of a queue or append-file op, carried in the op's 32 header bytes (and the
/// results of its reply, in the reply's header): `u64 a, u64 b, u32 c, u32 d, u32 e, u32 0`,
/// the same layout as an [`ObjectHeader`] (`version, size, block_count, block_size, flags`).
/// What each field means is per op (docs/PROTOCOL.md, "Queues and append files").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChannelArgs {
    /// First u64 (bytes 0..8).
    pub a: u64,
    /// Second u64 (bytes 8..16).
    pub b: u64,
    /// First u32 (bytes 16..20): the segment index.
    pub c: u32,
    /// Second u32 (bytes 20..24).
    pub d: u32,
    /// Third u32 (bytes 24..28).
    pub e: u32,
}

impl ChannelArgs {
    /// The arguments as the header fields that carry them.
    pub fn to_header(self) -> ObjectHeader {
        ObjectHeader {
            version: self.a,
            size: self.b,
            block_count: self.c,
            block_size: self.d,
            flags: self.e,
        }
    }

    /// The arguments carried by `header`'s fields.
    pub fn of_header(header: &ObjectHeader) -> Self {
        ChannelArgs {
            a: header.version,
            b: header.size,
            c: header.block_count,
            d: header.block_size,
            e: header.flags,
        }
    }
}

/// One request op of a frame; `value` shares the frame's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestOp {
    /// Client-chosen id echoed in the reply.
    pub request_id: u64,
    /// What to do.
    pub op: OpCode,
    /// `OP_FLAG_*` bits valid for `op`.
    pub flags: u8,
    /// Bucket name.
    pub bucket: String,
    /// Object key.
    pub key: String,
    /// Object header (PUT only; default otherwise).
    pub header: ObjectHeader,
    /// Value bytes (PUT of a small object only; empty otherwise).
    pub value: Bytes,
}

impl RequestOp {
    /// Whether GET should delete the object as it reads it.
    pub fn delete_on_read(&self) -> bool {
        self.flags & OP_FLAG_DELETE != 0
    }

    /// Whether a GET with DELETE claims only a small object's record (`OP_FLAG_CLAIM_WHOLE`).
    pub fn claim_whole(&self) -> bool {
        self.flags & OP_FLAG_CLAIM_WHOLE != 0
    }

    /// Whether PUT asks for PERSIST.
    pub fn persist(&self) -> bool {
        self.flags & OP_FLAG_PERSIST != 0
    }

    /// Whether PUT may replace an existing object.
    pub fn overwrite(&self) -> bool {
        self.flags & OP_FLAG_OVERWRITE != 0
    }

    /// Check the op's content (header geometry, value length, PERSIST agreement). Layout errors
    /// are found by [`decode_request_frame`] and end the session; these fail only the op.
    pub fn check(&self) -> Result<(), ProtocolError> {
        if self.op != OpCode::Put {
            return Ok(());
        }
        self.header.validate()?;
        let value_len = self.value.len() as u64;
        if !self.header.value_len_ok(value_len) {
            return Err(ProtocolError::ValueLength {
                value_len,
                size: self.header.size,
                block_count: self.header.block_count,
            });
        }
        if self.persist() != self.header.persist() {
            return Err(ProtocolError::PersistMismatch);
        }
        Ok(())
    }

    /// Bytes this op takes in a request frame.
    pub fn encoded_len(&self) -> usize {
        REQUEST_OP_HEAD_BYTES + self.bucket.len() + self.key.len() + self.value.len()
    }

    fn encode_into(&self, out: &mut BytesMut) {
        out.put_u64_le(self.request_id);
        out.put_u8(self.op.code());
        out.put_u8(self.flags);
        out.put_u16_le(self.bucket.len() as u16);
        out.put_u16_le(self.key.len() as u16);
        out.put_u16_le(0);
        out.put_u32_le(self.value.len() as u32);
        if self.op.takes_header() {
            out.put_slice(&self.header.encode());
        } else {
            out.put_bytes(0, HEADER_LEN_BYTES);
        }
        out.put_slice(self.bucket.as_bytes());
        out.put_slice(self.key.as_bytes());
        out.put_slice(&self.value);
    }
}

/// A decoded request frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestFrame {
    /// The weight-map epoch the client used for every op of the frame.
    pub epoch: u64,
    /// The ops, in frame order.
    pub ops: Vec<RequestOp>,
}

/// Little-endian reader over a frame that reports truncation as a typed error.
struct Cursor<'a> {
    buf: &'a Bytes,
    at: usize,
    what: &'static str,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, len: usize) -> Result<&'a [u8], ProtocolError> {
        let end = self
            .at
            .checked_add(len)
            .filter(|end| *end <= self.buf.len())
            .ok_or(ProtocolError::Truncated {
                what: self.what,
                needed: self.at.saturating_add(len),
                got: self.buf.len(),
            })?;
        let slice = &self.buf[self.at..end];
        self.at = end;
        Ok(slice)
    }

    fn take_bytes(&mut self, len: usize) -> Result<Bytes, ProtocolError> {
        let start = self.at;
        self.take(len)?;
        Ok(self.buf.slice(start..self.at))
    }

    fn u8(&mut self) -> Result<u8, ProtocolError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, ProtocolError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }

    fn u32(&mut self) -> Result<u32, ProtocolError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64, ProtocolError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn zeros(&mut self, len: usize, what: &'static str) -> Result<(), ProtocolError> {
        if self.take(len)?.iter().any(|b| *b != 0) {
            return Err(ProtocolError::ReservedNonZero(what));
        }
        Ok(())
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.at
    }
}

fn check_len(what: &'static str, len: usize, max: usize) -> Result<(), ProtocolError> {
    if len == 0 || len > max {
        return Err(ProtocolError::Length {
            what,
            len: len as u64,
            min: 1,
            max: max as u64,
        });
    }
    Ok(())
}

fn text(bytes: &[u8], what: &'static str) -> Result<String, ProtocolError> {
    std::str::from_utf8(bytes)
        .map(str::to_owned)
        .map_err(|_| ProtocolError::NotText(what))
}

/// Decode a request frame; any layout violation is an error that ends the session.
pub fn decode_request_frame(buf: &Bytes) -> Result<RequestFrame, ProtocolError> {
    if buf.len() > FRAME_MAX_BYTES {
        return Err(ProtocolError::FrameTooLarge(buf.len()));
    }
    let mut cur = Cursor {
        buf,
        at: 0,
        what: "frame head",
    };
    let version = cur.u8()?;
    if version != FRAME_VERSION {
        return Err(ProtocolError::FrameVersion(version));
    }
    cur.zeros(3, "frame head")?;
    let epoch = cur.u64()?;
    let count = cur.u32()?;
    if count == 0 || count > FRAME_OPS_MAX {
        return Err(ProtocolError::OpCount(count));
    }
    let mut ops = Vec::with_capacity(count as usize);
    cur.what = "op";
    for _ in 0..count {
        ops.push(decode_op(&mut cur)?);
    }
    if cur.remaining() != 0 {
        return Err(ProtocolError::TrailingBytes(cur.remaining()));
    }
    Ok(RequestFrame { epoch, ops })
}

fn decode_op(cur: &mut Cursor<'_>) -> Result<RequestOp, ProtocolError> {
    let request_id = cur.u64()?;
    let op = OpCode::from_code(cur.u8()?)?;
    let flags = cur.u8()?;
    if flags & !op.allowed_flags() != 0 {
        return Err(ProtocolError::OpFlags {
            op: op.name(),
            flags,
        });
    }
    let bucket_len = usize::from(cur.u16()?);
    let key_len = usize::from(cur.u16()?);
    cur.zeros(2, "op padding")?;
    let value_len = cur.u32()? as u64;
    check_len("bucket", bucket_len, BUCKET_NAME_MAX_BYTES)?;
    check_len("key", key_len, KEY_MAX_BYTES)?;
    let value_max = if op.takes_value() {
        SMALL_OBJECT_MAX_BYTES
    } else {
        0
    };
    if value_len > value_max {
        return Err(ProtocolError::Length {
            what: "value",
            len: value_len,
            min: 0,
            max: value_max,
        });
    }
    let header = if op.takes_header() {
        ObjectHeader::decode(cur.take(HEADER_LEN_BYTES)?)?
    } else {
        cur.zeros(HEADER_LEN_BYTES, "op header")?;
        ObjectHeader::default()
    };
    let bucket = text(cur.take(bucket_len)?, "bucket")?;
    let key = text(cur.take(key_len)?, "key")?;
    let value = cur.take_bytes(value_len as usize)?;
    Ok(RequestOp {
        request_id,
        op,
        flags,
        bucket,
        key,
        header,
        value,
    })
}

/// Encode a request frame (for clients and tests); the caller keeps within the frame bounds.
pub fn encode_request_frame(epoch: u64, ops: &[RequestOp]) -> Bytes {
    let len = REQUEST_FRAME_HEAD_BYTES + ops.iter().map(RequestOp::encoded_len).sum::<usize>();
    let mut out = BytesMut::with_capacity(len);
    out.put_u8(FRAME_VERSION);
    out.put_bytes(0, 3);
    out.put_u64_le(epoch);
    out.put_u32_le(ops.len() as u32);
    for op in ops {
        op.encode_into(&mut out);
    }
    out.freeze()
}

/// One reply of a reply frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// The request id of the op answered.
    pub request_id: u64,
    /// `STATUS_OK` or the gRPC code of the error kind.
    pub status: u8,
    /// The object header, when the reply carries one.
    pub header: Option<ObjectHeader>,
    /// The value (GET OK) or `"<kind>: <message>"` (errors); empty otherwise.
    pub body: Bytes,
}

impl Reply {
    /// Bytes this reply takes in a reply frame.
    pub fn encoded_len(&self) -> usize {
        REPLY_HEAD_BYTES
            + if self.header.is_some() {
                HEADER_LEN_BYTES
            } else {
                0
            }
            + self.body.len()
    }
}

/// Accumulates replies into one reply frame of at most `FRAME_MAX_BYTES`.
#[derive(Debug)]
pub struct ReplyFrameBuilder {
    buf: BytesMut,
    count: u32,
}

impl Default for ReplyFrameBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl ReplyFrameBuilder {
    /// An empty reply frame.
    pub fn new() -> Self {
        Self::with_capacity(REPLY_FRAME_CAPACITY_DEFAULT_BYTES)
    }

    /// An empty reply frame whose buffer holds `capacity_bytes` (head included) before it
    /// grows: a frame built at its final size is written once, not copied at each doubling.
    pub fn with_capacity(capacity_bytes: usize) -> Self {
        let mut buf = BytesMut::with_capacity(capacity_bytes.max(REPLY_FRAME_HEAD_BYTES));
        put_reply_frame_head(&mut buf, 0);
        Self { buf, count: 0 }
    }

    /// Number of replies so far.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Encoded bytes so far.
    pub fn len_bytes(&self) -> usize {
        self.buf.len()
    }

    /// Whether `reply` still fits in this frame.
    pub fn fits(&self, reply: &Reply) -> bool {
        self.count < REPLY_FRAME_REPLIES_MAX
            && self.buf.len() + reply.encoded_len() <= FRAME_MAX_BYTES
    }

    /// Append a reply; the caller checks [`ReplyFrameBuilder::fits`] first.
    pub fn push(&mut self, reply: &Reply) {
        debug_assert!(self.fits(reply), "reply frame overflow");
        put_reply_head(&mut self.buf, reply);
        self.buf.put_slice(&reply.body);
        self.count += 1;
    }

    /// The finished frame.
    pub fn finish(mut self) -> Bytes {
        self.buf[4..8].copy_from_slice(&self.count.to_le_bytes());
        self.buf.freeze()
    }
}

/// A reply frame's head: its version, three zero bytes and its count of replies.
fn put_reply_frame_head(buf: &mut BytesMut, count: u32) {
    buf.put_u8(FRAME_VERSION);
    buf.put_bytes(0, 3);
    buf.put_u32_le(count);
}

/// A reply's head (and object header, if any), as a reply frame carries it before the body.
fn put_reply_head(buf: &mut BytesMut, reply: &Reply) {
    buf.put_u64_le(reply.request_id);
    buf.put_u8(reply.status);
    buf.put_u8(if reply.header.is_some() {
        REPLY_FLAG_HEADER
    } else {
        0
    });
    buf.put_u16_le(0);
    buf.put_u32_le(reply.body.len() as u32);
    if let Some(header) = &reply.header {
        buf.put_slice(&header.encode());
    }
}

/// Reply bodies of at least this many bytes are pieces of their own in a [`ReplyFramePieces`]
/// (the bytes the store holds, not a copy); smaller ones are copied beside the reply heads, where
/// a piece of their own would cost more to write than the copy.
pub const REPLY_BODY_SHARED_MIN_BYTES: usize = 4096;

/// A reply frame as pieces that, written one after the other (a vectored write), are byte for
/// byte the frame [`ReplyFrameBuilder`] builds: a server that sends it this way does not copy
/// large bodies (a wide shuffle's small objects) into a frame buffer first.
#[derive(Debug)]
pub struct ReplyFramePieces {
    /// Reply heads and small bodies since the last shared body.
    heads: BytesMut,
    pieces: Vec<Bytes>,
    count: u32,
    len_bytes: usize,
}

impl ReplyFramePieces {
    /// The bytes `reply` adds to the heads' buffer (all of it but a shared body).
    pub fn unshared_len(reply: &Reply) -> usize {
        match reply.body.len() >= REPLY_BODY_SHARED_MIN_BYTES {
            true => reply.encoded_len() - reply.body.len(),
            false => reply.encoded_len(),
        }
    }

    /// An empty frame whose heads' buffer holds `heads_capacity_bytes` (the sum of
    /// [`ReplyFramePieces::unshared_len`] of its replies) before it grows.
    pub fn with_capacity(heads_capacity_bytes: usize) -> Self {
        Self {
            heads: BytesMut::with_capacity(heads_capacity_bytes),
            pieces: Vec::new(),
            count: 0,
            len_bytes: REPLY_FRAME_HEAD_BYTES,
        }
    }

    /// Number of replies so far.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Whether `reply` still fits in this frame.
    pub fn fits(&self, reply: &Reply) -> bool {
        self.count < REPLY_FRAME_REPLIES_MAX
            && self.len_bytes + reply.encoded_len() <= FRAME_MAX_BYTES
    }

    /// Append a reply; the caller checks [`ReplyFramePieces::fits`] first.
    pub fn push(&mut self, reply: &Reply) {
        debug_assert!(self.fits(reply), "reply frame overflow");
        put_reply_head(&mut self.heads, reply);
        if reply.body.len() >= REPLY_BODY_SHARED_MIN_BYTES {
            // Split off what is written so far; the rest of the buffer stays for what follows.
            self.pieces.push(self.heads.split().freeze());
            self.pieces.push(reply.body.clone());
        } else {
            self.heads.put_slice(&reply.body);
        }
        self.count += 1;
        self.len_bytes += reply.encoded_len();
    }

    /// The finished frame's pieces, in order (none empty), and its length in bytes.
    pub fn finish(mut self) -> (Vec<Bytes>, usize) {
        let mut head = BytesMut::with_capacity(REPLY_FRAME_HEAD_BYTES);
        put_reply_frame_head(&mut head, self.count);
        let mut pieces = Vec::with_capacity(self.pieces.len() + 2);
        pieces.push(head.freeze());
        pieces.extend(self.pieces.drain(..).filter(|piece| !piece.is_empty()));
        if !self.heads.is_empty() {
            pieces.push(self.heads.freeze());
        }
        (pieces, self.len_bytes)
    }
}

/// Decode a reply frame (for clients and tests).
pub fn decode_reply_frame(buf: &Bytes) -> Result<Vec<Reply>, ProtocolError> {
    if buf.len() > FRAME_MAX_BYTES {
        return Err(ProtocolError::FrameTooLarge(buf.len()));
    }
    let mut cur = Cursor {
        buf,
        at: 0,
        what: "reply frame head",
    };
    let version = cur.u8()?;
    if version != FRAME_VERSION {
        return Err(ProtocolError::FrameVersion(version));
    }
    cur.zeros(3, "reply frame head")?;
    let count = cur.u32()?;
    if count > REPLY_FRAME_REPLIES_MAX {
        return Err(ProtocolError::OpCount(count));
    }
    cur.what = "reply";
    let mut replies = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let request_id = cur.u64()?;
        let status = cur.u8()?;
        let flags = cur.u8()?;
        if flags & !REPLY_FLAG_HEADER != 0 {
            return Err(ProtocolError::OpFlags { op: "reply", flags });
        }
        cur.zeros(2, "reply padding")?;
        let body_len = cur.u32()? as usize;
        let header = if flags & REPLY_FLAG_HEADER != 0 {
            Some(ObjectHeader::decode(cur.take(HEADER_LEN_BYTES)?)?)
        } else {
            None
        };
        let body = cur.take_bytes(body_len)?;
        replies.push(Reply {
            request_id,
            status,
            header,
            body,
        });
    }
    if cur.remaining() != 0 {
        return Err(ProtocolError::TrailingBytes(cur.remaining()));
    }
    Ok(replies)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_frame_pieces_are_the_builders_frame_with_large_bodies_shared() {
        let header = ObjectHeader {
            version: 7,
            size: 5000,
            block_count: 0,
            block_size: 0,
            flags: 0,
        };
        let large = Bytes::from(vec![3u8; REPLY_BODY_SHARED_MIN_BYTES]);
        let replies: Vec<Reply> = [
            (None, Bytes::from_static(b"not_found: b/k")),
            (Some(header), large.clone()),
            (Some(header), large.clone()),
            (Some(header), Bytes::new()),
            (
                None,
                Bytes::from(vec![9u8; REPLY_BODY_SHARED_MIN_BYTES - 1]),
            ),
            (Some(header), large.clone()),
        ]
        .into_iter()
        .enumerate()
        .map(|(id, (header, body))| Reply {
            request_id: id as u64,
            status: if header.is_some() { STATUS_OK } else { 5 },
            header,
            body,
        })
        .collect();
        for count in 0..=replies.len() {
            let mut builder = ReplyFrameBuilder::new();
            let heads: usize = replies[..count]
                .iter()
                .map(ReplyFramePieces::unshared_len)
                .sum();
            let mut pieces = ReplyFramePieces::with_capacity(heads);
            for reply in &replies[..count] {
                assert!(pieces.fits(reply));
                builder.push(reply);
                pieces.push(reply);
            }
            assert_eq!(pieces.count(), count as u32);
            let (parts, len_bytes) = pieces.finish();
            let joined: Vec<u8> = parts.iter().flat_map(|p| p.iter().copied()).collect();
            let built = builder.finish();
            assert_eq!(len_bytes, built.len());
            assert_eq!(joined, built.to_vec());
            assert!(parts.iter().all(|p| !p.is_empty()));
            // Each large body is a piece of its own, the very bytes of the reply.
            let shared = parts
                .iter()
                .filter(|p| p.as_ptr() == large.as_ptr())
                .count();
            assert_eq!(
                shared,
                replies[..count]
                    .iter()
                    .filter(|r| r.body.len() == large.len())
                    .count()
            );
            assert_eq!(
                decode_reply_frame(&Bytes::from(joined)).unwrap(),
                replies[..count]
            );
        }
    }
    use crate::error::ErrorKind;

    fn put_op(id: u64, value: &'static [u8]) -> RequestOp {
        RequestOp {
            request_id: id,
            op: OpCode::Put,
            flags: OP_FLAG_OVERWRITE,
            bucket: "b".into(),
            key: format!("k{id}"),
            header: ObjectHeader {
                version: 9,
                size: value.len() as u64,
                ..Default::default()
            },
            value: Bytes::from_static(value),
        }
    }

    fn get_op(id: u64) -> RequestOp {
        RequestOp {
            request_id: id,
            op: OpCode::Get,
            flags: OP_FLAG_DELETE,
            bucket: "bucket".into(),
            key: "ключ".into(),
            header: ObjectHeader::default(),
            value: Bytes::new(),
        }
    }

    fn sample_frame() -> Bytes {
        encode_request_frame(3, &[put_op(1, b"hello"), get_op(2), put_op(3, b"")])
    }

    #[test]
    fn request_round_trip() {
        let ops = vec![put_op(1, b"hello"), get_op(2), put_op(3, b"")];
        let frame = encode_request_frame(3, &ops);
        let decoded = decode_request_frame(&frame).unwrap();
        assert_eq!(decoded.epoch, 3);
        assert_eq!(decoded.ops, ops);
        assert!(decoded.ops.iter().all(|op| op.check().is_ok()));
        assert!(decoded.ops[1].delete_on_read());
        assert!(decoded.ops[0].overwrite() && !decoded.ops[0].persist());
    }

    #[test]
    fn value_shares_the_frame_buffer() {
        let frame = sample_frame();
        let decoded = decode_request_frame(&frame).unwrap();
        let value = &decoded.ops[0].value;
        let frame_range = frame.as_ptr() as usize..frame.as_ptr() as usize + frame.len();
        assert!(frame_range.contains(&(value.as_ptr() as usize)));
    }

    #[test]
    fn reply_round_trip() {
        let replies = vec![
            Reply {
                request_id: 7,
                status: STATUS_OK,
                header: None,
                body: Bytes::new(),
            },
            Reply {
                request_id: 8,
                status: STATUS_OK,
                header: Some(ObjectHeader {
                    version: 1,
                    size: 3,
                    ..Default::default()
                }),
                body: Bytes::from_static(b"abc"),
            },
            Reply {
                request_id: 9,
                status: ErrorKind::NotFound.grpc_code(),
                header: None,
                body: Bytes::from_static(b"not_found: b/k"),
            },
        ];
        let mut builder = ReplyFrameBuilder::new();
        for reply in &replies {
            assert!(builder.fits(reply));
            builder.push(reply);
        }
        assert_eq!(builder.count(), 3);
        assert_eq!(decode_reply_frame(&builder.finish()).unwrap(), replies);
    }

    #[test]
    fn reply_builder_respects_frame_bound() {
        let body = Bytes::from(vec![0u8; 60 * 1024]);
        let reply = Reply {
            request_id: 1,
            status: 0,
            header: None,
            body,
        };
        let mut builder = ReplyFrameBuilder::new();
        let mut pushed = 0;
        while builder.fits(&reply) {
            builder.push(&reply);
            pushed += 1;
        }
        let frame = builder.finish();
        assert!(frame.len() <= FRAME_MAX_BYTES);
        assert_eq!(
            pushed,
            (FRAME_MAX_BYTES - REPLY_FRAME_HEAD_BYTES) / reply.encoded_len()
        );
    }

    fn patched(frame: &Bytes, at: usize, bytes: &[u8]) -> Bytes {
        let mut v = frame.to_vec();
        v[at..at + bytes.len()].copy_from_slice(bytes);
        Bytes::from(v)
    }

    #[test]
    fn every_malformed_variant_is_rejected() {
        let frame = sample_frame();
        let op0 = REQUEST_FRAME_HEAD_BYTES;
        let err = |b: Bytes| decode_request_frame(&b).unwrap_err();

        assert!(matches!(err(Bytes::new()), ProtocolError::Truncated { .. }));
        assert!(matches!(
            err(frame.slice(..10)),
            ProtocolError::Truncated { .. }
        ));
        assert!(matches!(
            err(frame.slice(..frame.len() - 1)),
            ProtocolError::Truncated { .. }
        ));
        assert!(matches!(
            err(patched(&frame, 0, &[2])),
            ProtocolError::FrameVersion(2)
        ));
        assert!(matches!(
            err(patched(&frame, 2, &[1])),
            ProtocolError::ReservedNonZero("frame head")
        ));
        assert!(matches!(
            err(patched(&frame, 12, &0u32.to_le_bytes())),
            ProtocolError::OpCount(0)
        ));
        assert!(matches!(
            err(patched(&frame, 12, &1025u32.to_le_bytes())),
            ProtocolError::OpCount(1025)
        ));
        assert!(matches!(
            err(patched(&frame, 12, &2u32.to_le_bytes())),
            ProtocolError::TrailingBytes(_)
        ));
        assert!(matches!(
            err(patched(&frame, 12, &4u32.to_le_bytes())),
            ProtocolError::Truncated { .. }
        ));
        assert!(matches!(
            err(patched(&frame, op0 + 8, &[13])),
            ProtocolError::OpCode(13)
        ));
        assert!(matches!(
            err(patched(&frame, op0 + 8, &[0])),
            ProtocolError::OpCode(0)
        ));
        assert!(matches!(
            err(patched(&frame, op0 + 9, &[1])),
            ProtocolError::OpFlags { op: "put", .. }
        ));
        assert!(matches!(
            err(patched(&frame, op0 + 9, &[0x80])),
            ProtocolError::OpFlags { .. }
        ));
        assert!(matches!(
            err(patched(&frame, op0 + 10, &[0, 0])),
            ProtocolError::Length { what: "bucket", .. }
        ));
        assert!(matches!(
            err(patched(&frame, op0 + 10, &256u16.to_le_bytes())),
            ProtocolError::Length { .. }
        ));
        assert!(matches!(
            err(patched(&frame, op0 + 12, &[0, 0])),
            ProtocolError::Length { what: "key", .. }
        ));
        assert!(matches!(
            err(patched(&frame, op0 + 12, &1025u16.to_le_bytes())),
            ProtocolError::Length { .. }
        ));
        assert!(matches!(
            err(patched(&frame, op0 + 14, &[0, 1])),
            ProtocolError::ReservedNonZero("op padding")
        ));
        let too_big = (SMALL_OBJECT_MAX_BYTES as u32 + 1).to_le_bytes();
        assert!(matches!(
            err(patched(&frame, op0 + 16, &too_big)),
            ProtocolError::Length { what: "value", .. }
        ));
        assert!(matches!(
            err(patched(&frame, op0 + 52, &[0xff])),
            ProtocolError::NotText("bucket")
        ));
        assert!(matches!(
            err(patched(&frame, op0 + 53, &[0xc3])),
            ProtocolError::NotText("key")
        ));

        let get_at = op0 + put_op(1, b"hello").encoded_len();
        assert!(matches!(
            err(patched(&frame, get_at + 9, &[2])),
            ProtocolError::OpFlags { op: "get", .. }
        ));
        assert!(matches!(
            err(patched(&frame, get_at + 16, &[1])),
            ProtocolError::Length { what: "value", .. }
        ));
        assert!(matches!(
            err(patched(&frame, get_at + 20, &[1])),
            ProtocolError::ReservedNonZero("op header")
        ));

        let mut huge = frame.to_vec();
        huge.resize(FRAME_MAX_BYTES + 1, 0);
        assert!(matches!(
            err(Bytes::from(huge)),
            ProtocolError::FrameTooLarge(_)
        ));
    }

    #[test]
    fn op_content_errors_fail_the_op_only() {
        let mut op = put_op(1, b"hello");
        op.header.size = 4;
        assert!(matches!(op.check(), Err(ProtocolError::ValueLength { .. })));
        let mut op = put_op(1, b"hello");
        op.header.version = 0;
        assert!(matches!(op.check(), Err(ProtocolError::Header(_))));
        let mut op = put_op(1, b"hello");
        op.flags |= OP_FLAG_PERSIST;
        assert!(matches!(op.check(), Err(ProtocolError::PersistMismatch)));
        let mut manifest = put_op(1, b"x");
        manifest.header = ObjectHeader {
            version: 2,
            size: 10 << 20,
            block_count: 10,
            block_size: 1 << 20,
            flags: 0,
        };
        assert!(matches!(
            manifest.check(),
            Err(ProtocolError::ValueLength { .. })
        ));
        manifest.value = Bytes::new();
        assert!(manifest.check().is_ok());
    }

    #[test]
    fn malformed_reply_frames_are_rejected() {
        let mut builder = ReplyFrameBuilder::new();
        builder.push(&Reply {
            request_id: 1,
            status: 0,
            header: None,
            body: Bytes::from_static(b"xy"),
        });
        let frame = builder.finish();
        assert!(matches!(
            decode_reply_frame(&frame.slice(..frame.len() - 1)),
            Err(ProtocolError::Truncated { .. })
        ));
        assert!(matches!(
            decode_reply_frame(&patched(&frame, 17, &[2])),
            Err(ProtocolError::OpFlags { .. })
        ));
        let mut extra = frame.to_vec();
        extra.push(0);
        assert!(matches!(
            decode_reply_frame(&Bytes::from(extra)),
            Err(ProtocolError::TrailingBytes(1))
        ));
    }
}
