//! The data blocks of large objects, read straight into the caller's memory: each server's
//! blocks as DoGet tickets read in parallel, with fallbacks for blocks written under an earlier
//! weight map (or, for an overflowed object, before its writer learnt that a server was full),
//! and several objects at once for `get_many`.

use std::collections::HashMap;
use std::sync::Mutex;

use pocketflow_protocol::limits::TICKET_RANGES_MAX;
use pocketflow_protocol::ticket::{BlockRange, GetTicket};
use tonic::Code;

use crate::blocks::{split_dest, RangeTarget};
use crate::error::ClientError;
use crate::failure::{body, server_error, Failure};
use crate::homes::Layout;
use crate::objects::{Objects, STALE_EPOCH_RETRIES_MAX};
use crate::parallel::{push_grouped, run_parallel};
use crate::placement::placed_block;
use crate::records::Record;
use crate::view::View;

/// Fewest blocks of one object that one read ticket carries: a large object's blocks on one
/// server are read as several tickets in parallel, each at least this many blocks.
pub const READ_TICKET_BLOCKS_MIN: usize = 4;
/// `get_many` reads the data blocks of at most this many large objects at once (fewer if
/// `io_threads` is smaller); each one already spreads its blocks over the I/O threads.
pub const LARGE_OBJECTS_IN_FLIGHT_MAX: usize = 4;

/// One object of `read_objects`: its key, layout and destination.
type ObjectDest<'a> = (&'a str, &'a Layout, &'a mut [u8]);

/// What one read has received so far, per data block.
type Received = Mutex<HashMap<u32, u64>>;

impl Objects {
    /// Read the data blocks of many large objects, each into its own destination, at most
    /// `LARGE_OBJECTS_IN_FLIGHT_MAX` objects at once; returns each read's outcome in order.
    pub fn read_objects(
        &self,
        bucket: &str,
        reads: &mut [(&str, Layout, &mut [u8])],
        delete: bool,
    ) -> Vec<Result<(), Failure>> {
        let objects_at_once = LARGE_OBJECTS_IN_FLIGHT_MAX.min(self.io_threads).max(1);
        // Each read's destination goes to the one task that fills it (taken out of its slot).
        let slots: Vec<Mutex<Option<ObjectDest<'_>>>> = reads
            .iter_mut()
            .map(|(key, layout, dest)| Mutex::new(Some((*key, &*layout, &mut **dest))))
            .collect();
        let tasks: Vec<usize> = (0..slots.len()).collect();
        run_parallel(&tasks, objects_at_once, |task| {
            let taken = slots[task].lock().expect("never poisoned").take();
            let (key, layout, dest) = taken.expect("each read is one task's");
            self.read_blocks(bucket, key, layout, 0, layout.header.size, delete, dest)
        })
    }

    /// Fill `dest` with the object's bytes from `start` on: from the record of a small object,
    /// else from the data blocks its manifest names.
    pub(crate) fn fill(
        &self,
        bucket: &str,
        key: &str,
        record: &Record,
        start: u64,
        delete: bool,
        dest: &mut [u8],
    ) -> Result<(), Failure> {
        let end = start + dest.len() as u64;
        match record.header {
            Some(header) if header.block_count > 0 => {
                let layout = Layout::of_record(header, &record.body)
                    .map_err(|e| Failure::at(e, &record.server))?;
                self.read_blocks(bucket, key, &layout, start, end, delete, dest)
            }
            _ => {
                dest.copy_from_slice(&record.body[start as usize..end as usize]);
                Ok(())
            }
        }
    }

    /// Read object bytes `[start, end)` of a large object from its data blocks into `dest`
    /// (`end - start` bytes). Each server's blocks go as tickets of at least
    /// `READ_TICKET_BLOCKS_MIN` blocks, read in parallel on up to `io_threads` threads.
    #[allow(clippy::too_many_arguments)]
    pub fn read_blocks(
        &self,
        bucket: &str,
        key: &str,
        layout: &Layout,
        start: u64,
        end: u64,
        delete: bool,
        dest: &mut [u8],
    ) -> Result<(), Failure> {
        let header = &layout.header;
        let view = self.view();
        let block_size = u64::from(header.block_size);
        if block_size == 0 || start >= end || end > header.size {
            return Err(Failure::local(ClientError::Protocol(format!(
                "manifest of {bucket}/{key} cannot hold bytes {start}..{end}"
            ))));
        }
        let expected = end - start;
        if dest.len() as u64 != expected {
            return Err(Failure::local(ClientError::InvalidArgument(format!(
                "destination of {} bytes for {expected} bytes",
                dest.len()
            ))));
        }
        let first = (start / block_size + 1) as u32;
        let last = ((end - 1) / block_size + 1) as u32;
        let mut groups: Vec<(&str, Vec<RangeTarget>)> = Vec::new();
        for index in first..=last {
            let block_start = u64::from(index - 1) * block_size;
            let low = start.max(block_start);
            let high = end.min(block_start + block_size).min(header.size);
            let server = layout.block_home(&view, key.as_bytes(), index)?;
            let range = RangeTarget {
                block: index,
                offset: low - block_start,
                len: high - low,
                dest_at: (low - start) as usize,
            };
            push_grouped(&mut groups, &server.address, range);
        }
        let blocks = (last - first + 1) as usize;
        // A block may be elsewhere when the map changed since it was written, or when an
        // overflowed object's streamed writer stored it before it learnt a server was full.
        let moved = view.epoch > 1 || !layout.skipped.is_empty();
        // A DELETE ticket that fails frees every block it names on its server (nobody else can
        // reach them), so where blocks may be elsewhere each block goes as a ticket of its own:
        // a block missing from one server costs no other block.
        let per_ticket = if delete && moved {
            1
        } else {
            READ_TICKET_BLOCKS_MIN
                .max(blocks.div_ceil(self.io_threads))
                .min(TICKET_RANGES_MAX)
        };
        let tasks: Vec<(&str, &[RangeTarget])> = groups
            .iter()
            .flat_map(|(address, ranges)| {
                ranges
                    .chunks(per_ticket)
                    .map(move |chunk| (*address, chunk))
            })
            .collect();
        // The ranges tile the destination in block order: split it into one slice per range,
        // so that every ticket writes only slices of its own (no two `&mut` overlap).
        let mut ordered: Vec<&RangeTarget> = groups.iter().flat_map(|(_, r)| r.iter()).collect();
        ordered.sort_by_key(|range| range.dest_at);
        let mut pieces: HashMap<u32, &mut [u8]> = ordered
            .iter()
            .map(|range| range.block)
            .zip(split_dest(dest, &ordered).map_err(Failure::local)?)
            .collect();
        let slots: Vec<Mutex<Vec<&mut [u8]>>> = tasks
            .iter()
            .map(|(_, chunk)| {
                let mine = chunk
                    .iter()
                    .map(|range| pieces.remove(&range.block).expect("one piece per range"))
                    .collect();
                Mutex::new(mine)
            })
            .collect();
        let received: Received = Mutex::new(HashMap::new());
        let indexes: Vec<usize> = (0..tasks.len()).collect();
        let fetch = |task: usize| -> Result<(), Failure> {
            let (address, chunk) = tasks[task];
            // Only this task takes this slot's lock: it never waits.
            let mut dests = slots[task].lock().expect("never poisoned");
            let read = ReadOf {
                objects: self,
                bucket,
                key,
                version: header.version,
                block_count: header.block_count,
                delete,
                received: &received,
            };
            match read.ranges_current(address, chunk, &mut dests) {
                Err(failure) if failure.error.is_not_found() && moved => {
                    read.moved_blocks(&view, address, chunk, &mut dests)
                }
                other => other,
            }
        };
        let outcomes = run_parallel(&indexes, self.io_threads, fetch);
        if let Some(failure) = outcomes.into_iter().find_map(Result::err) {
            return Err(failure);
        }
        let got: u64 = received.lock().expect("never poisoned").values().sum();
        if got != expected {
            return Err(Failure::local(ClientError::Protocol(format!(
                "read {got} bytes of {key:?}, expected {expected}"
            ))));
        }
        Ok(())
    }
}

/// One object version's block reads, shared by the tickets of one [`Objects::read_blocks`].
struct ReadOf<'a> {
    objects: &'a Objects,
    bucket: &'a str,
    key: &'a str,
    version: u64,
    /// The object's data blocks (where each lives depends on it).
    block_count: u32,
    delete: bool,
    received: &'a Received,
}

impl ReadOf<'_> {
    /// One DoGet of `ranges` from `address` with the newest context, counting what arrived per
    /// block; a stale epoch (refused before any byte was sent) is adopted and the ticket sent
    /// again.
    fn ranges_current(
        &self,
        address: &str,
        ranges: &[RangeTarget],
        dests: &mut [&mut [u8]],
    ) -> Result<(), Failure> {
        let connection = self
            .objects
            .connection(address)
            .map_err(|e| Failure::at(e, address))?;
        for attempt in 0..=STALE_EPOCH_RETRIES_MAX {
            let view = self.objects.view();
            let ticket = GetTicket {
                ctx: view.ctx.clone(),
                bucket: self.bucket.to_string(),
                key: self.key.to_string(),
                version: self.version,
                ranges: ranges
                    .iter()
                    .map(|r| BlockRange(r.block, r.offset, r.len))
                    .collect(),
                delete: self.delete,
            };
            let ticket = body(&ticket);
            match connection.get_ranges_blocking(ticket, ranges, dests) {
                Err(error) if error.is_stale_epoch() => {
                    self.objects
                        .adopt_or_fail(Failure::at(error, address), attempt)?;
                }
                Err(error) => return Err(Failure::at(error, address)),
                Ok(outcome) => {
                    let mut received = self.received.lock().expect("never poisoned");
                    for (range, count) in ranges.iter().zip(&outcome.received) {
                        if *count > 0 {
                            *received.entry(range.block).or_insert(0) += count;
                        }
                    }
                    return match outcome.error {
                        Some(error) => Err(Failure::at(error, address)),
                        None => Ok(()),
                    };
                }
            }
        }
        unreachable!("the last attempt returns")
    }

    /// Find blocks that are not where the read looked (written under an earlier weight map, or
    /// by an overflowing streamed upload before it learnt that their server was full), after
    /// the ticket of `ranges` to `tried` failed with `not_found`. A ticket stops at its first
    /// missing block: that block is looked for on the other servers in the ranking of its
    /// placement (its manifest's, for an object of one data block), and the ranges after it,
    /// never asked for, are asked of `tried` again (so on, at most once per range).
    fn moved_blocks(
        &self,
        view: &View,
        tried: &str,
        ranges: &[RangeTarget],
        dests: &mut [&mut [u8]],
    ) -> Result<(), Failure> {
        let mut remaining = ranges;
        let mut remaining_dests = dests;
        loop {
            let missing = {
                let received = self.received.lock().expect("never poisoned");
                remaining
                    .iter()
                    .position(|r| received.get(&r.block) != Some(&r.len))
            };
            let Some(at) = missing else {
                return Ok(());
            };
            let (head, rest) = remaining_dests.split_at_mut(at + 1);
            self.probe_elsewhere(view, tried, &remaining[at], &mut head[at])?;
            remaining = &remaining[at + 1..];
            remaining_dests = rest;
            if remaining.is_empty() {
                return Ok(());
            }
            match self.ranges_current(tried, remaining, remaining_dests) {
                Err(failure) if failure.error.is_not_found() => {}
                other => return other,
            }
        }
    }

    /// Read `range` into `dest` from the first server other than `tried` in its block's
    /// ranking that holds it; `not_found` (or the lost servers' `unavailable`, or
    /// `suspect_server` when a suspect it did not wait on may hold it) when none does.
    fn probe_elsewhere(
        &self,
        view: &View,
        tried: &str,
        range: &RangeTarget,
        dest: &mut &mut [u8],
    ) -> Result<(), Failure> {
        self.received
            .lock()
            .expect("never poisoned")
            .remove(&range.block);
        let placed = placed_block(range.block, self.block_count);
        let mut suspect_skipped = None;
        for server in view.ranked(self.key.as_bytes(), placed) {
            if server.address == tried {
                continue;
            }
            if view.is_suspect(&server.node_id) {
                // It may hang: never wait on it; say so if the block is nowhere else.
                suspect_skipped.get_or_insert(server);
                continue;
            }
            let dest = std::slice::from_mut(dest);
            match self.ranges_current(&server.address, std::slice::from_ref(range), dest) {
                Ok(()) => return Ok(()),
                Err(failure) if failure.error.is_not_found() => {
                    self.received
                        .lock()
                        .expect("never poisoned")
                        .remove(&range.block);
                }
                Err(failure) => return Err(failure),
            }
        }
        let what = format!("block {} of {}/{}", range.block, self.bucket, self.key);
        if let Some(suspect) = suspect_skipped {
            let error = server_error(
                Code::Unavailable as i32,
                "suspect_server",
                format!(
                    "{what} may be on {}, which does not answer (a suspect of epoch {})",
                    suspect.node_id, view.epoch
                ),
            );
            return Err(Failure::at(error, &suspect.address));
        }
        if let Some((error, server)) = view.lost_error(&what) {
            return Err(Failure { error, server });
        }
        Err(Failure::local(server_error(
            Code::NotFound as i32,
            "not_found",
            format!("{what} is on no server of the job"),
        )))
    }
}
