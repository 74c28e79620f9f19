//! Whole reads of one object: block 0 from its home (by one direct READ that brings a small
//! object's value, or an object's one data block, along), then its data blocks; and reads of a
//! byte range. The caller's [`Destination`] gives the memory once the size is known.

use pocketflow_protocol::frame::{OpCode, OP_FLAG_CLAIM_WHOLE, OP_FLAG_DELETE};
use pocketflow_protocol::limits::BLOCK_SIZE_MAX_BYTES;
use pocketflow_protocol::ticket::ReadTicket;

use crate::connection::{ExchangeReply, ExchangeRequest};
use crate::error::ClientError;
use crate::failure::{body, failure_reply, Failure};
use crate::objects::Objects;
use crate::parallel::run_parallel;
use crate::records::record_request;
use crate::view::{Server, View};

/// Where a read puts an object's bytes once it knows their size.
pub trait Destination {
    /// Memory for `size` bytes (exactly `size`, or at least `size` for a caller's buffer), or
    /// an error that ends the read (the object is then put back if the read was a DELETE).
    fn buffer(&mut self, size: usize) -> Result<&mut [u8], ClientError>;

    /// The most bytes [`Destination::buffer`] can give, when it is bounded (a caller's buffer);
    /// `None` when it allocates what the object needs.
    fn room(&self) -> Option<usize> {
        None
    }
}

/// How many more times a DELETE read of a striped object reads the key again after it lost the
/// claim of the version it read (another reader took it, or an overwrite replaced it): a newer
/// version is read once more; a key that is gone answers `not_found`.
pub const DELETE_READ_RETRIES_MAX: usize = 1;

/// One attempt of a read: the object's size, or a DELETE read that lost the version it read.
enum Attempt {
    Read(usize),
    Lost(Failure),
}

impl Objects {
    /// Read the object into the memory `dest` gives for its size; returns the size. With
    /// `delete` the object is removed as it is read: exactly one of concurrent DELETE readers
    /// gets it, and a reader that fails or dies before it has the bytes leaves it readable
    /// (a small object, or one of one data block, is claimed with its bytes in one exchange; a
    /// striped object's manifest only after its blocks were read: see [`Objects::claim_record`]).
    /// If `dest` refuses the size, a DELETE read puts a small object back first.
    pub fn get(
        &self,
        bucket: &str,
        key: &str,
        delete: bool,
        dest: &mut dyn Destination,
    ) -> Result<usize, Failure> {
        for attempt in 0..=DELETE_READ_RETRIES_MAX {
            match self.get_once(bucket, key, delete, dest)? {
                Attempt::Read(size) => return Ok(size),
                Attempt::Lost(lost) if attempt == DELETE_READ_RETRIES_MAX => return Err(lost),
                Attempt::Lost(_) => {}
            }
        }
        unreachable!("the last attempt returns")
    }

    /// [`Objects::get`] of each of `keys`, `io_threads` at once, each into a destination of its
    /// own made by `new_dest`: each key's destination once it holds the object, or the key's
    /// failure, in order. For a DELETE reader of many objects of one data block: each is one
    /// READ that claims the record with its block, where `get_many`'s read of a striped object
    /// takes a block read, then a delete action and a block-delete action per object.
    pub fn get_each<D: Destination + Send>(
        &self,
        bucket: &str,
        keys: &[&str],
        delete: bool,
        new_dest: impl Fn() -> D + Sync,
    ) -> Vec<Result<D, Failure>> {
        run_parallel(keys, self.io_threads.max(1), |key| {
            let mut dest = new_dest();
            self.get(bucket, key, delete, &mut dest).map(|_| dest)
        })
    }

    fn get_once(
        &self,
        bucket: &str,
        key: &str,
        delete: bool,
        dest: &mut dyn Destination,
    ) -> Result<Attempt, Failure> {
        let flags = if delete {
            OP_FLAG_DELETE | OP_FLAG_CLAIM_WHOLE
        } else {
            0
        };
        let request = record_request(bucket, key, OpCode::Get, flags);
        let mut delivered = None;
        let record = self.fetch_record_with(&request, true, &mut |view, server| {
            let read = self.read_at_home(view, server, &request, &mut *dest)?;
            if let Some(size) = read.1 {
                delivered = Some(size);
            }
            Ok(read.0)
        })?;
        if let Some(size) = delivered {
            return Ok(Attempt::Read(size));
        }
        // OP_FLAG_CLAIM_WHOLE: only a small object's record was taken by the read.
        let claimed = delete && !record.has_blocks();
        let size = usize::try_from(record.size()).map_err(|_| {
            Failure::local(ClientError::InvalidArgument(format!(
                "an object of {} bytes does not fit this process's memory",
                record.size()
            )))
        })?;
        let buffer = match dest.buffer(size) {
            Ok(buffer) => buffer,
            Err(error) => {
                let error = if claimed {
                    match self.restore_record(&record, bucket, key) {
                        Ok(()) => error,
                        Err(why) => ClientError::InvalidArgument(format!(
                            "{}; the object could not be put back: {why}",
                            error.to_string().trim_start_matches("invalid_argument: ")
                        )),
                    }
                } else {
                    error
                };
                return Err(Failure::local(error));
            }
        };
        let filled = self.fill(bucket, key, &record, 0, false, &mut buffer[..size]);
        if !delete || claimed {
            filled?;
            return Ok(Attempt::Read(size));
        }
        match filled {
            // A block gone: the winner of a DELETE race freed it, or an overwrite replaced it.
            Err(failure) if failure.error.is_not_found() => return Ok(Attempt::Lost(failure)),
            other => other?,
        }
        match self.claim_record(&record, bucket, key)? {
            Some(lost) => Ok(Attempt::Lost(lost)),
            None => Ok(Attempt::Read(size)),
        }
    }

    /// Ask block 0's home for the record of a GET `request` with a direct READ, which brings a
    /// small object's value, or the data block of an object of one data block, along into
    /// `dest`; returns the record's reply and, when the whole object is in `dest`, its size.
    /// Over Flight, or from a server without READ, the record comes over a session alone.
    fn read_at_home(
        &self,
        view: &View,
        server: &Server,
        request: &ExchangeRequest,
        dest: &mut dyn Destination,
    ) -> Result<(ExchangeReply, Option<usize>), Failure> {
        let connection = self
            .connection(&server.address)
            .map_err(|e| Failure::at(e, &server.address))?;
        let room = dest.room().map_or(u64::MAX, |room| room as u64);
        let ticket = body(&ReadTicket {
            ctx: view.ctx.clone(),
            bucket: request.bucket.clone(),
            key: request.key.clone(),
            delete: request.flags & OP_FLAG_DELETE != 0,
            claim_whole: request.flags & OP_FLAG_CLAIM_WHOLE != 0,
            inline_bytes_max: room.min(u64::from(BLOCK_SIZE_MAX_BYTES)),
        });
        let read = match connection.read_object_blocking(&ticket, dest) {
            Ok(Some(read)) => read,
            Ok(None) => {
                let reply = self.call_or_stale(view, &server.address, request.clone())?;
                return Ok((reply, None));
            }
            // The ticket's context was refused before the record was looked at.
            Err(error) if error.is_stale_epoch() => return Ok((failure_reply(&error), None)),
            Err(error) => return Err(Failure::at(error, &server.address)),
        };
        if let Some(error) = read.error {
            // A small object's value the destination refused is the reply's body: the caller
            // asks the destination again and, for a DELETE read, puts the object back.
            let small = read.reply.header.filter(|h| h.block_count == 0);
            if read.received == 0 && small.is_some_and(|h| read.reply.body.len() as u64 == h.size) {
                return Ok((read.reply, None));
            }
            return Err(Failure::at(error, &server.address));
        }
        let whole = match read.reply.header {
            // A fence: the caller reads through it.
            Some(header) if header.fence() => None,
            Some(header) if read.reply.status == 0 && read.received > 0 => {
                if read.received != header.size {
                    return Err(Failure::at(
                        ClientError::Protocol(format!(
                            "a READ brought {} of {} bytes",
                            read.received, header.size
                        )),
                        &server.address,
                    ));
                }
                Some(header.size as usize)
            }
            // An empty small object is whole with no byte.
            Some(header)
                if read.reply.status == 0 && header.block_count == 0 && header.size == 0 =>
            {
                Some(dest.buffer(0).map(|_| 0).map_err(Failure::local)?)
            }
            Some(header) if read.reply.status == 0 && header.block_count == 0 => {
                return Err(Failure::at(
                    ClientError::Protocol("a READ's small object came without its bytes".into()),
                    &server.address,
                ));
            }
            _ => None,
        };
        Ok((read.reply, whole))
    }

    /// Bytes `[offset, offset + length)` of the object, cut at its end, into the memory `dest`
    /// gives for their count; returns the count.
    pub fn get_range(
        &self,
        bucket: &str,
        key: &str,
        offset: u64,
        length: u64,
        dest: &mut dyn Destination,
    ) -> Result<usize, Failure> {
        let record = self.fetch_record(bucket, key, OpCode::Get, 0, true)?;
        let size = record.size();
        let end = size.min(offset.saturating_add(length));
        let count = end.saturating_sub(offset) as usize;
        let buffer = dest.buffer(count).map_err(Failure::local)?;
        if count > 0 {
            self.fill(bucket, key, &record, offset, false, &mut buffer[..count])?;
        }
        Ok(count)
    }
}
