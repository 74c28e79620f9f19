//! Direct-exchange sessions (`pocketflow_protocol::direct`): the small-operation frames of a
//! DoExchange session over a plain TCP connection, written and read on the calling thread with
//! blocking I/O. No runtime thread is involved, so a small operation costs one round trip and no
//! thread handoffs; the bounded pool and the failure rules are those of DoExchange sessions.

use std::collections::HashMap;
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use pocketflow_protocol::batch::GetPieceMeta;
use pocketflow_protocol::direct::{
    decode_head, decode_status, encode_head, Kind, DATA_META_BYTES, DIRECT_MAGIC,
    MESSAGE_HEAD_BYTES, PIECE_META_BYTES,
};
use pocketflow_protocol::frame::{decode_reply_frame, Reply};
use pocketflow_protocol::header::ObjectHeader;
use pocketflow_protocol::limits::BATCH_MAX_BYTES;

use crate::blocks::{contains, BlockSlice, ObjectRead, RangeTarget, ReadOutcome};
use crate::connection::ExchangeReply;
use crate::error::ClientError;
use crate::pool::{no_free_session, Acquired, PoolState, Pooled};
use crate::reads::Destination;
use crate::session::SessionFailure;
use crate::tls::{ClientTls, DirectStream};

/// Reply bytes read ahead per system call: a whole small reply frame arrives in one read.
const READ_BUFFER_BYTES: usize = 64 * 1024;
/// Largest message copied behind its head into one write; larger payloads go out on their own.
const COALESCE_MAX_BYTES: usize = 64 * 1024;
/// How long a refused upload waits for the server's STATUS after its writes stopped.
const REFUSAL_READ_TIMEOUT: Duration = Duration::from_millis(500);

/// One open direct-exchange connection, used by one caller at a time.
pub(crate) struct DirectSession {
    reader: BufReader<DirectStream>,
    out: Vec<u8>,
    read_timeout: Option<Duration>,
    next_id: u64,
    /// Whether an operation already ran on it (a reused session may have gone stale).
    pub(crate) used: bool,
    /// Whether it must not be reused.
    pub(crate) broken: bool,
}

impl Pooled for DirectSession {
    fn broken(&self) -> bool {
        self.broken
    }
}

fn unavailable(what: &str, error: &io::Error) -> ClientError {
    ClientError::Unavailable(format!("{what}: {error}"))
}

/// The error of a failed read that waited at most `timeout`.
fn read_error(error: io::Error, timeout: Duration) -> ClientError {
    match error.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ClientError::Unavailable(format!(
            "no reply within {:.1}s; session cancelled",
            timeout.as_secs_f64()
        )),
        io::ErrorKind::UnexpectedEof => {
            ClientError::Unavailable("the server ended the session".into())
        }
        _ => unavailable("the session broke", &error),
    }
}

/// What came next in a transfer's answer ([`DirectSession::next_piece`]).
enum Next {
    /// A DATA piece; its bytes follow on the connection.
    Piece(GetPieceMeta),
    /// END: the answer is complete.
    End,
    /// The transfer ended here with this error (the connection is marked broken).
    Failed(ClientError),
}

impl DirectSession {
    /// Connect to `address`, open a session with the job's descriptor command and wait for the
    /// server's answer, all within `timeout`.
    pub(crate) fn open(
        address: &str,
        command: &[u8],
        timeout: Duration,
        tls: Option<&ClientTls>,
    ) -> Result<DirectSession, ClientError> {
        let mut session = DirectSession::connect(address, timeout, timeout, tls)?;
        session
            .write_message(Kind::Open, command)
            .map_err(|e| unavailable("cannot open a session", &e))?;
        match session.read_message(timeout)? {
            (Kind::Ready, _) => Ok(session),
            (kind, payload) => Err(session.unexpected(kind, &payload, "its answer to open")),
        }
    }

    /// Connect to `address` within `timeout`; the magic goes out with the first message. Every
    /// write may then wait `write_timeout` for the server to take bytes.
    pub(crate) fn connect(
        address: &str,
        timeout: Duration,
        write_timeout: Duration,
        tls: Option<&ClientTls>,
    ) -> Result<DirectSession, ClientError> {
        let addrs: Vec<_> = address
            .to_socket_addrs()
            .map_err(|e| unavailable(&format!("cannot resolve {address}"), &e))?
            .collect();
        let mut last = None;
        let mut stream = None;
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let Some(stream) = stream else {
            let e = last.unwrap_or_else(|| io::Error::other("no address"));
            return Err(unavailable(&format!("cannot connect to {address}"), &e));
        };
        let setup = stream.set_nodelay(true).and_then(|()| {
            stream.set_write_timeout(Some(write_timeout.max(Duration::from_millis(1))))
        });
        setup.map_err(|e| unavailable("cannot set up the connection", &e))?;
        let stream = match tls {
            None => DirectStream::Plain(stream),
            Some(tls) => {
                stream
                    .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
                    .map_err(|e| unavailable("cannot set up the connection", &e))?;
                tls.handshake(address, stream)?
            }
        };
        let mut session = DirectSession {
            reader: BufReader::with_capacity(READ_BUFFER_BYTES, stream),
            out: Vec::new(),
            read_timeout: None,
            next_id: 1,
            used: false,
            broken: false,
        };
        session.out.extend_from_slice(DIRECT_MAGIC);
        Ok(session)
    }

    /// Write one message; small payloads go out in one write with the head (and with anything
    /// already in `out`).
    fn write_message(&mut self, kind: Kind, payload: &[u8]) -> io::Result<()> {
        self.out
            .extend_from_slice(&encode_head(kind, payload.len()));
        let stream = self.reader.get_mut();
        if payload.len() <= COALESCE_MAX_BYTES {
            self.out.extend_from_slice(payload);
            let written = stream.write_all(&self.out);
            self.out.clear();
            written
        } else {
            let written = stream
                .write_all(&self.out)
                .and_then(|()| stream.write_all(payload));
            self.out.clear();
            written
        }
    }

    /// Read one message within `timeout`; a failure breaks the session.
    fn read_message(&mut self, timeout: Duration) -> Result<(Kind, Bytes), ClientError> {
        let result = self.read_message_inner(timeout);
        if result.is_err() {
            self.broken = true;
        }
        result
    }

    fn read_message_inner(&mut self, timeout: Duration) -> Result<(Kind, Bytes), ClientError> {
        let (kind, len) = self.read_head(timeout)?;
        // Read into spare capacity: a zeroed buffer of a reply frame (up to about 1 MiB of
        // small objects' bodies) cost a memset of every byte before the read overwrote it.
        let mut payload = Vec::with_capacity(len);
        (&mut self.reader)
            .take(len as u64)
            .read_to_end(&mut payload)
            .map_err(|e| read_error(e, timeout))?;
        if payload.len() < len {
            let eof = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
            return Err(read_error(eof, timeout));
        }
        Ok((kind, Bytes::from(payload)))
    }

    /// Read a message head within `timeout` (the payload is the caller's to read).
    fn read_head(&mut self, timeout: Duration) -> Result<(Kind, usize), ClientError> {
        let timeout = timeout.max(Duration::from_millis(1));
        if self.read_timeout != Some(timeout) {
            self.reader
                .get_ref()
                .tcp()
                .set_read_timeout(Some(timeout))
                .map_err(|e| unavailable("cannot set the read bound", &e))?;
            self.read_timeout = Some(timeout);
        }
        let mut head = [0u8; MESSAGE_HEAD_BYTES];
        self.reader
            .read_exact(&mut head)
            .map_err(|e| read_error(e, timeout))?;
        decode_head(&head).map_err(|e| ClientError::Protocol(e.to_string()))
    }

    /// The error for a message of the wrong kind: a status ends the session with its error.
    fn unexpected(&mut self, kind: Kind, payload: &[u8], wanted: &str) -> ClientError {
        self.broken = true;
        if kind == Kind::Status {
            return match decode_status(payload) {
                Ok((code, message)) => {
                    ClientError::from(tonic::Status::new(tonic::Code::from(code as i32), message))
                }
                Err(e) => ClientError::Protocol(e.to_string()),
            };
        }
        ClientError::Protocol(format!("a {kind:?} message where {wanted} was expected"))
    }

    /// Whether the server closed the connection or said something while the session was idle.
    fn ended_while_idle(&mut self) -> bool {
        if !self.reader.buffer().is_empty() || self.reader.get_mut().has_buffered_plaintext() {
            return true;
        }
        let mut byte = 0u8;
        let fd = self.reader.get_ref().tcp().as_raw_fd();
        // SAFETY: a one-byte peek into a local buffer on a socket this session owns.
        let n = unsafe {
            libc::recv(
                fd,
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            let error = io::Error::last_os_error();
            return error.kind() != io::ErrorKind::WouldBlock;
        }
        true
    }

    /// Before a pooled connection is used again: fail (nothing sent) if it ended while idle.
    fn check_reusable(&mut self) -> Result<(), SessionFailure> {
        if self.used && self.ended_while_idle() {
            self.broken = true;
            return Err(SessionFailure::new(
                ClientError::Unavailable("the pooled connection had ended".into()),
                false,
            ));
        }
        Ok(())
    }

    /// Reserve `count` consecutive request ids; returns the first.
    pub(crate) fn take_ids(&mut self, count: usize) -> u64 {
        let first = self.next_id;
        self.next_id += count as u64;
        first
    }

    /// Run `frames` of ops (encoded with ids from [`DirectSession::take_ids`]), keeping at
    /// most `window` ops in flight; returns the replies by request id.
    pub(crate) fn run(
        &mut self,
        frames: Vec<(Bytes, Vec<u64>)>,
        window: usize,
        op_timeout: Duration,
        first_reply_timeout: Duration,
    ) -> Result<HashMap<u64, Reply>, SessionFailure> {
        self.check_reusable()?;
        let mut first = !self.used;
        self.used = true;
        let total: usize = frames.iter().map(|(_, ids)| ids.len()).sum();
        let mut replies: HashMap<u64, Reply> = HashMap::with_capacity(total);
        let mut pending: HashMap<u64, ()> = HashMap::with_capacity(window.min(total));
        let mut frames = frames.into_iter().peekable();
        let mut sent_any = false;
        while frames.peek().is_some() || !pending.is_empty() {
            if let Some((_, ids)) = frames.peek() {
                if pending.is_empty() || pending.len() + ids.len() <= window {
                    let (frame, ids) = frames.next().expect("peeked");
                    if let Err(e) = self.write_message(Kind::Frame, &frame) {
                        self.broken = true;
                        return Err(SessionFailure::new(
                            unavailable("cannot send to the server", &e),
                            sent_any,
                        ));
                    }
                    sent_any = true;
                    for id in ids {
                        pending.insert(id, ());
                    }
                    continue;
                }
            }
            let bound = if first {
                first_reply_timeout
            } else {
                op_timeout
            };
            first = false;
            let batch = self.receive(bound)?;
            for reply in batch {
                if pending.remove(&reply.request_id).is_none() {
                    return Err(self.violation(&format!(
                        "reply for unknown request id {}",
                        reply.request_id
                    )));
                }
                replies.insert(reply.request_id, reply);
            }
        }
        Ok(replies)
    }

    fn receive(&mut self, timeout: Duration) -> Result<Vec<Reply>, SessionFailure> {
        let (kind, payload) = self
            .read_message(timeout)
            .map_err(|e| SessionFailure::new(e, true))?;
        if kind != Kind::Frame {
            let error = self.unexpected(kind, &payload, "a reply frame");
            return Err(SessionFailure::new(error, true));
        }
        decode_reply_frame(&payload).map_err(|e| self.violation(&e.to_string()))
    }

    /// Start a transfer on this block connection: send `kind` with its `ticket`. Nothing was
    /// sent when this fails.
    fn begin(&mut self, kind: Kind, ticket: &[u8]) -> Result<(), SessionFailure> {
        self.check_reusable()?;
        self.used = true;
        if let Err(e) = self.write_message(kind, ticket) {
            self.broken = true;
            return Err(SessionFailure::new(
                unavailable("cannot send to the server", &e),
                false,
            ));
        }
        Ok(())
    }

    /// The next message of a transfer's answer, within `deadline`: a DATA piece's metadata
    /// (its bytes follow on the connection; DATA is a protocol violation unless
    /// `data_expected`), END, or the failure that ended the transfer here (a timeout, a lost
    /// connection, a STATUS from the server; the connection is then marked broken).
    fn next_piece(
        &mut self,
        op_timeout: Duration,
        deadline: Instant,
        data_expected: bool,
    ) -> Result<Next, SessionFailure> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            self.broken = true;
            let error = ClientError::Unavailable("the read did not finish in time".into());
            return Ok(Next::Failed(error));
        }
        let (kind, len) = match self.read_head(op_timeout.min(left)) {
            Ok(head) => head,
            Err(error) => {
                self.broken = true;
                return Ok(Next::Failed(error));
            }
        };
        match kind {
            Kind::End if len == 0 => return Ok(Next::End),
            Kind::Data if len >= DATA_META_BYTES && data_expected => {}
            Kind::Status => {
                let mut payload = vec![0u8; len];
                let error = match self.reader.read_exact(&mut payload) {
                    Ok(()) => self.unexpected(kind, &payload, "data"),
                    Err(e) => read_error(e, op_timeout),
                };
                self.broken = true;
                return Ok(Next::Failed(error));
            }
            _ => return Err(self.violation(&format!("a {kind:?} message of {len} bytes"))),
        }
        let mut meta = [0u8; DATA_META_BYTES];
        if let Err(e) = self.reader.read_exact(&mut meta) {
            self.broken = true;
            return Ok(Next::Failed(read_error(e, op_timeout)));
        }
        Ok(Next::Piece(GetPieceMeta {
            block_index: u32::from_le_bytes(meta[..4].try_into().expect("4 bytes")),
            offset: u64::from_le_bytes(meta[4..].try_into().expect("8 bytes")),
            len: (len - DATA_META_BYTES) as u64,
        }))
    }

    /// Read a DoGet ticket's ranges into `dests` (one per range, checked): send GET,
    /// then place each DATA piece where its range says, until END. A failure before any byte
    /// arrived is the `Err`; one after is the outcome's error (as over DoGet).
    pub(crate) fn get_ranges(
        &mut self,
        ticket: &[u8],
        ranges: &[RangeTarget],
        dests: &mut [&mut [u8]],
        op_timeout: Duration,
        deadline: Instant,
    ) -> Result<ReadOutcome, SessionFailure> {
        self.begin(Kind::Get, ticket)?;
        let mut received = vec![0u64; ranges.len()];
        let mut current = 0usize;
        let outcome = |received: Vec<u64>, error: ClientError| {
            if received.iter().all(|&n| n == 0) {
                Err(SessionFailure::new(error, true))
            } else {
                Ok(ReadOutcome {
                    received,
                    error: Some(error),
                })
            }
        };
        loop {
            let piece = match self.next_piece(op_timeout, deadline, true)? {
                Next::Piece(piece) => piece,
                Next::End => {
                    return Ok(ReadOutcome {
                        received,
                        error: None,
                    })
                }
                Next::Failed(error) => return outcome(received, error),
            };
            while current < ranges.len() && !contains(&ranges[current], &piece) {
                current += 1;
            }
            let Some(range) = ranges.get(current) else {
                return Err(self.violation(&format!(
                    "a piece of block {} at {} is in no range of the ticket",
                    piece.block_index, piece.offset
                )));
            };
            let at = (piece.offset - range.offset) as usize;
            let target = &mut dests[current][at..at + piece.len as usize];
            if let Err(e) = self.reader.read_exact(target) {
                self.broken = true;
                return outcome(received, read_error(e, op_timeout));
            }
            received[current] += piece.len;
        }
    }

    /// Read an object whole with a READ `ticket`: the record's reply, then the bytes that come
    /// with it, placed in the memory `dest` gives once the first of them arrives (a small
    /// object's value that `dest` refuses is kept as the reply's body instead, so a DELETE read
    /// can put it back). A failure before the reply is the `Err`; one after it is the read's
    /// error, with what arrived.
    pub(crate) fn read_object(
        &mut self,
        ticket: &[u8],
        dest: &mut dyn Destination,
        op_timeout: Duration,
        deadline: Instant,
    ) -> Result<ObjectRead, SessionFailure> {
        self.begin(Kind::Read, ticket)?;
        let left = deadline.saturating_duration_since(Instant::now());
        let (kind, payload) = self
            .read_message(op_timeout.min(left))
            .map_err(|e| SessionFailure::new(e, true))?;
        if kind != Kind::Frame {
            let error = self.unexpected(kind, &payload, "a READ's reply");
            return Err(SessionFailure::new(error, true));
        }
        let mut replies =
            decode_reply_frame(&payload).map_err(|e| self.violation(&e.to_string()))?;
        if replies.len() != 1 {
            return Err(self.violation(&format!("a READ answered with {} replies", replies.len())));
        }
        let reply = replies.pop().expect("one reply");
        let mut read = ObjectRead {
            reply: ExchangeReply {
                status: reply.status,
                header: reply.header,
                body: reply.body,
            },
            received: 0,
            error: None,
        };
        let size = match (read.reply.status, read.reply.header) {
            (0, Some(header)) => header,
            (0, None) => return Err(self.violation("a READ's OK reply without a header")),
            _ => ObjectHeader::default(),
        };
        let mut memory: Option<&mut [u8]> = None;
        loop {
            let (block, offset, piece_len) =
                match self.next_piece(op_timeout, deadline, read.reply.status == 0)? {
                    Next::Piece(piece) => (piece.block_index, piece.offset, piece.len),
                    Next::End => return Ok(read),
                    Next::Failed(error) => {
                        read.error = Some(error);
                        return Ok(read);
                    }
                };
            // A small object's value is block 0; the one data block of an object of one data
            // block is block 1: either way the object's bytes from `offset`.
            let expected_block = u32::from(size.block_count == 1);
            let fits = offset
                .checked_add(piece_len)
                .is_some_and(|end| end <= size.size);
            if block != expected_block || size.block_count > 1 || !fits {
                return Err(self.violation(&format!(
                    "a piece of block {block} at {offset} of an object of {} bytes in {} blocks",
                    size.size, size.block_count
                )));
            }
            if memory.is_none() {
                match dest.buffer(size.size as usize) {
                    Ok(buffer) => memory = Some(buffer),
                    Err(error) if size.block_count == 0 => {
                        // The value is at most a small object: kept, so it can be put back.
                        let mut value = vec![0u8; size.size as usize];
                        let target = &mut value[offset as usize..(offset + piece_len) as usize];
                        if let Err(e) = self.reader.read_exact(target) {
                            self.broken = true;
                            read.error = Some(read_error(e, op_timeout));
                            return Ok(read);
                        }
                        read.reply.body = Bytes::from(value);
                        read.error = Some(error);
                        // The END follows; the connection is not reused.
                        self.broken = true;
                        return Ok(read);
                    }
                    Err(error) => {
                        self.broken = true;
                        read.error = Some(error);
                        return Ok(read);
                    }
                }
            }
            let buffer = memory.as_deref_mut().expect("allocated above");
            let target = &mut buffer[offset as usize..(offset + piece_len) as usize];
            if let Err(e) = self.reader.read_exact(target) {
                self.broken = true;
                read.error = Some(read_error(e, op_timeout));
                return Ok(read);
            }
            read.received += piece_len;
        }
    }

    /// Write data blocks as one upload: PUT with the DoPut descriptor, each block in PIECE
    /// messages of at most `BATCH_MAX_BYTES` read straight from the caller's memory, END; returns
    /// the server's result JSON. A refusal the server sends while pieces are still going out
    /// stops the upload and is the error.
    pub(crate) fn put_blocks(
        &mut self,
        descriptor: &[u8],
        blocks: &[BlockSlice<'_>],
        op_timeout: Duration,
        deadline: Instant,
    ) -> Result<Bytes, SessionFailure> {
        self.check_reusable()?;
        self.used = true;
        // The PUT, each piece's head and the END go out in the same system call as the piece
        // bytes next to them: one write (and one wake-up of the server) for a one-piece upload.
        self.out
            .extend_from_slice(&encode_head(Kind::Put, descriptor.len()));
        self.out.extend_from_slice(descriptor);
        let end = encode_head(Kind::End, 0);
        let pieces = blocks
            .iter()
            .map(|b| b.data.len().div_ceil(BATCH_MAX_BYTES as usize))
            .sum::<usize>();
        let mut sent = 0usize;
        for block in blocks {
            let block_len = (block.data.len() as u64).to_le_bytes();
            for piece in block.data.chunks(BATCH_MAX_BYTES as usize) {
                if Instant::now() > deadline {
                    self.broken = true;
                    let error =
                        ClientError::Unavailable("the upload did not finish in time".into());
                    return Err(SessionFailure::new(error, true));
                }
                // The server refused the upload (full tier, bad block): stop sending, read why.
                if sent > 0 && self.ended_while_idle() {
                    return Err(self.refusal(op_timeout));
                }
                self.out
                    .extend_from_slice(&encode_head(Kind::Piece, PIECE_META_BYTES + piece.len()));
                self.out.extend_from_slice(&block.index.to_le_bytes());
                self.out.extend_from_slice(&block_len);
                sent += 1;
                let last: &[u8] = if sent == pieces { &end } else { &[] };
                let mut parts = [
                    IoSlice::new(&self.out),
                    IoSlice::new(piece),
                    IoSlice::new(last),
                ];
                let written = write_all_parts(self.reader.get_mut(), &mut parts);
                self.out.clear();
                if written.is_err() {
                    return Err(self.refusal(op_timeout));
                }
            }
        }
        if pieces == 0 {
            // No piece at all: the PUT and the END alone.
            self.out.extend_from_slice(&end);
            let written = self.reader.get_mut().write_all(&self.out);
            self.out.clear();
            if written.is_err() {
                return Err(self.refusal(op_timeout));
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match self.read_message(op_timeout.min(left).max(Duration::from_millis(1))) {
            Ok((Kind::Stored, result)) => Ok(result),
            Ok((kind, payload)) => {
                let error = self.unexpected(kind, &payload, "the upload's result");
                Err(SessionFailure::new(error, true))
            }
            Err(error) => Err(SessionFailure::new(error, true)),
        }
    }

    /// After an upload stopped early: the server's STATUS if it sent one, else unavailable.
    fn refusal(&mut self, op_timeout: Duration) -> SessionFailure {
        self.broken = true;
        let error = match self.read_message(op_timeout.min(REFUSAL_READ_TIMEOUT)) {
            Ok((kind, payload)) => self.unexpected(kind, &payload, "the upload's result"),
            Err(error) => error,
        };
        SessionFailure::new(error, true)
    }

    fn violation(&mut self, what: &str) -> SessionFailure {
        self.broken = true;
        SessionFailure::new(ClientError::Protocol(what.to_string()), true)
    }
}

/// Write every byte of `parts`, in order, in as few system calls as the kernel takes them.
fn write_all_parts(stream: &mut DirectStream, mut parts: &mut [IoSlice<'_>]) -> io::Result<()> {
    // Advancing drops empty slices (a write of only empty slices would look like WriteZero).
    IoSlice::advance_slices(&mut parts, 0);
    while !parts.is_empty() {
        match stream.write_vectored(parts) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut parts, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The idle direct connections of one kind to one server; callers that find none free block
/// until one is.
pub(crate) struct DirectPool {
    state: Mutex<Waited>,
    freed: Condvar,
}

/// A pool's state and how many callers wait for a session of it, so that giving one back
/// wakes somebody only when somebody waits (a wake-up is a system call, on every operation).
struct Waited {
    pool: PoolState<DirectSession>,
    waiting: usize,
}

impl DirectPool {
    pub(crate) fn new(limit: usize) -> Self {
        DirectPool {
            state: Mutex::new(Waited {
                pool: PoolState::new(limit),
                waiting: 0,
            }),
            freed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Waited> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An idle session, or a slot to open one; waits up to `patience` when all are in use.
    /// `fresh` first retires every idle session (they may all be stale).
    pub(crate) fn acquire(
        &self,
        patience: Duration,
        fresh: bool,
    ) -> Result<Acquired<DirectSession>, ClientError> {
        let deadline = Instant::now() + patience;
        let mut state = self.lock();
        if fresh {
            state.pool.retire_idle();
        }
        loop {
            if let Some(acquired) = state.pool.try_acquire()? {
                return Ok(acquired);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(no_free_session(patience));
            }
            state.waiting += 1;
            state = self
                .freed
                .wait_timeout(state, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            state.waiting -= 1;
        }
    }

    /// Give back a session (or the slot of one that failed to open, with `None`).
    pub(crate) fn release(&self, session: Option<Box<DirectSession>>) {
        let mut state = self.lock();
        state.pool.release(session);
        let wake = state.waiting > 0;
        drop(state);
        if wake {
            self.freed.notify_one();
        }
    }

    /// After the server refused a new session: keep to the sessions already open, if any.
    pub(crate) fn shrink(&self) -> bool {
        self.lock().pool.shrink()
    }

    /// Drop every idle session and refuse new acquisitions.
    pub(crate) fn close(&self) {
        let idle = self.lock().pool.close();
        drop(idle);
        self.freed.notify_all();
    }
}
