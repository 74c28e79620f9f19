//! A streamed upload: the data blocks of one new object arrive one by one (a file-like writer,
//! a stream of unknown length) and go out in the background, grouped per server, while the
//! writer goes on; [`StreamUpload::commit`] then writes the manifest, the commit point.
//!
//! Block 1 waits until a second block comes: an object of one data block keeps that block on its
//! manifest's home (`objects::block_home`), so only the commit knows where it goes; it then
//! goes there with the manifest in one upload, as [`Objects::put`] sends such an object.
//!
//! Memory stays bounded: a server's blocks are sent once `STREAM_GROUP_BYTES_MIN` bytes wait
//! for it, at most `STREAM_PENDING_GROUPS_MAX` groups' worth of bytes wait in all, and at most
//! `io_threads` groups are on the wire at once (the writer waits for one to finish).
//!
//! A server that refuses a group as full is skipped from then on, by that group and by every
//! later one (`overflow.rs`), and the manifest names what was skipped. Blocks a server took
//! before it refused are left where they are (the writer no longer holds them): a reader
//! looks for them where the list puts them, then where the map did (`block_reads.rs`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::blocks::BlockSlice;
use crate::error::ClientError;
use crate::failure::Failure;
use crate::homes::block_home;
use crate::objects::{Objects, STALE_EPOCH_RETRIES_MAX};
use crate::overflow::Overflowing;
use crate::writes::{kind_is, large_header, new_version, refused, BlockUpload, NewRecord, Placed};

/// A streamed upload sends a server's blocks once this many bytes are waiting for it.
pub const STREAM_GROUP_BYTES_MIN: usize = 4 * 1024 * 1024;
/// A streamed upload holds at most this many groups' worth of unsent bytes in total.
pub const STREAM_PENDING_GROUPS_MAX: usize = 4;
/// The block count a streamed upload places its blocks with once it has more than one: any count
/// above one places alike (see `placement::placed_block`).
const MORE_THAN_ONE_BLOCK: u32 = 2;

/// What a send gives back: its outcome, and the blocks it sent.
type SendOutcome<B> = (Result<(), Failure>, Vec<(u32, B)>);

/// The blocks waiting for one server.
struct Group<B> {
    address: String,
    blocks: Vec<(u32, B)>,
    bytes: usize,
}

/// The data blocks of one new version of an object, sent as they come (see the module doc).
/// `B` is whatever holds a block's bytes until it is sent (a `Vec`, a caller's buffer).
pub struct StreamUpload<B: AsRef<[u8]> + Send + 'static> {
    objects: Arc<Objects>,
    bucket: String,
    key: String,
    version: u64,
    block_size: u32,
    persist: bool,
    group_bytes: usize,
    /// Block 1 while it is the only block added (see the module doc).
    first: Option<B>,
    /// Blocks added so far.
    blocks_added: u32,
    pending: Vec<Group<B>>,
    pending_bytes: usize,
    /// Sends on the wire; each gives its blocks back, so that they are released by the thread
    /// that waits for it (a caller's buffer may need the caller's interpreter lock to release).
    in_flight: VecDeque<JoinHandle<SendOutcome<B>>>,
    in_flight_max: usize,
    placed: Arc<Mutex<Placed>>,
    /// The servers the blocks skip (full ones), shared with the sends.
    overflow: Arc<Overflowing>,
    failures: Vec<Failure>,
    done: bool,
}

impl<B: AsRef<[u8]> + Send + 'static> StreamUpload<B> {
    /// A new upload of `bucket/key` in the job's block size; fails only when the kernel gives
    /// no random bytes for its version.
    pub fn new(
        objects: Arc<Objects>,
        bucket: &str,
        key: &str,
        persist: bool,
    ) -> Result<Self, Failure> {
        let version = new_version().map_err(Failure::local)?;
        let view = objects.view();
        let block_size = view.block_size;
        let in_flight_max = objects.io_threads.max(1);
        // Servers of the map that refused a write as full a moment ago are skipped at once.
        let full = objects.recently_full(
            &view,
            key.as_bytes(),
            MORE_THAN_ONE_BLOCK,
            persist,
            view.servers.iter(),
        );
        Ok(StreamUpload {
            objects,
            bucket: bucket.to_string(),
            key: key.to_string(),
            version,
            block_size,
            persist,
            group_bytes: STREAM_GROUP_BYTES_MIN.max(block_size as usize),
            first: None,
            blocks_added: 0,
            pending: Vec::new(),
            pending_bytes: 0,
            in_flight: VecDeque::new(),
            in_flight_max,
            placed: Arc::new(Mutex::new(Placed::new())),
            overflow: Arc::new(full),
            failures: Vec::new(),
            done: false,
        })
    }

    /// The version the object gets.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The block size of the upload.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Queue data block `index` (1-based); may send groups (waiting for a slot on the wire),
    /// and returns the failure of an earlier send. Block 1 waits for a second block (see the
    /// module doc).
    pub fn add(&mut self, index: u32, block: B) -> Result<(), Failure> {
        self.first_failure()?;
        self.blocks_added += 1;
        if index == 1 && self.blocks_added == 1 {
            self.first = Some(block);
            return Ok(());
        }
        if let Some(first) = self.first.take() {
            self.queue(1, first)?;
        }
        self.queue(index, block)
    }

    /// Queue block `index` of an object of more than one data block for its home.
    fn queue(&mut self, index: u32, block: B) -> Result<(), Failure> {
        let view = self.objects.view();
        let key = self.key.as_bytes();
        let skipped = self.overflow.skipped();
        let address = block_home(
            &view,
            key,
            index,
            MORE_THAN_ONE_BLOCK,
            self.persist,
            &skipped,
        )
        .map_err(|failure| self.overflow.explain(failure, &self.what()))?
        .address
        .clone();
        let len = block.as_ref().len();
        let slot = match self.pending.iter().position(|g| g.address == address) {
            Some(slot) => slot,
            None => {
                self.pending.push(Group {
                    address,
                    blocks: Vec::new(),
                    bytes: 0,
                });
                self.pending.len() - 1
            }
        };
        let group = &mut self.pending[slot];
        group.blocks.push((index, block));
        group.bytes += len;
        self.pending_bytes += len;
        if group.bytes >= self.group_bytes {
            self.submit(slot);
        } else if self.pending_bytes >= STREAM_PENDING_GROUPS_MAX * self.group_bytes {
            let fullest = (0..self.pending.len())
                .max_by_key(|&i| self.pending[i].bytes)
                .expect("bytes are pending");
            self.submit(fullest);
        }
        self.first_failure()
    }

    /// Send what is queued, wait for every send, then store the manifest of an object of `size`
    /// bytes (exactly the blocks added, else `InvalidArgument`); an object of one data block goes
    /// whole in one upload. On failure the blocks are freed, unless the manifest was sent and its
    /// outcome is unknown (the record may point at them).
    pub fn commit(&mut self, size: u64, overwrite: bool) -> Result<(), Failure> {
        let header = large_header(self.version, size, self.block_size, self.persist);
        if header.block_count != self.blocks_added {
            self.abort();
            return Err(Failure {
                error: ClientError::InvalidArgument(format!(
                    "an upload of {} blocks cannot commit an object of {size} bytes \
                     ({} blocks of {} bytes)",
                    self.blocks_added, header.block_count, self.block_size
                )),
                server: String::new(),
            });
        }
        if let Some(first) = self.first.take() {
            self.done = true;
            let objects = self.objects.clone();
            return objects.put_large(&self.bucket, &self.key, header, first.as_ref(), overwrite);
        }
        let what = self.what();
        let sent = self
            .finish_sends()
            .and_then(|()| self.overflow.manifest_value(&what));
        let (flag, value) = match sent {
            Ok(value) => value,
            Err(failure) => {
                self.free();
                return Err(self.overflow.explain(failure, &what));
            }
        };
        let record = NewRecord {
            key: &self.key,
            header: pocketflow_protocol::header::ObjectHeader {
                flags: header.flags | flag,
                ..header
            },
            value: &value,
            shared: None,
        };
        let stored = self
            .objects
            .put_records(&self.bucket, &[record], self.persist, overwrite);
        self.done = true;
        if let Err(failure) = &stored {
            if refused(&failure.error) {
                self.free_placed();
            }
        }
        stored
    }

    /// Discard the upload: wait for the sends in progress, then free every block sent. Does
    /// nothing after a commit was attempted.
    pub fn abort(&mut self) {
        if self.done {
            return;
        }
        self.first = None;
        self.pending.clear();
        self.pending_bytes = 0;
        self.wait_for_slots(0);
        self.free();
    }

    fn free(&mut self) {
        self.done = true;
        self.free_placed();
    }

    /// The object, as errors name it.
    fn what(&self) -> String {
        format!("{}/{}", self.bucket, self.key)
    }

    fn free_placed(&self) {
        let placed = std::mem::take(&mut *self.placed.lock().expect("never poisoned"));
        if !placed.is_empty() {
            self.objects
                .delete_block_groups(&self.bucket, &self.key, self.version, &placed);
        }
    }

    /// Send every queued group and wait for all sends; the first failure, a full tier first.
    fn finish_sends(&mut self) -> Result<(), Failure> {
        while !self.pending.is_empty() {
            self.submit(self.pending.len() - 1);
        }
        self.wait_for_slots(0);
        self.first_failure()
    }

    fn first_failure(&self) -> Result<(), Failure> {
        let first = self
            .failures
            .iter()
            .find(|f| kind_is(&f.error, "capacity_exhausted"))
            .or(self.failures.first());
        match first {
            Some(failure) => Err(failure.clone()),
            None => Ok(()),
        }
    }

    /// Wait until at most `most` sends are on the wire, collecting their failures.
    fn wait_for_slots(&mut self, most: usize) {
        while self.in_flight.len() > most {
            let send = self.in_flight.pop_front().expect("a send is in flight");
            match send.join() {
                Ok((Ok(()), _blocks)) => {}
                Ok((Err(failure), _blocks)) => self.failures.push(failure),
                Err(_) => self.failures.push(Failure {
                    error: crate::ClientError::Protocol("a block send panicked".into()),
                    server: String::new(),
                }),
            }
        }
    }

    /// Send the group in `slot` on a thread of its own, once a slot on the wire is free.
    fn submit(&mut self, slot: usize) {
        let group = self.pending.swap_remove(slot);
        self.pending_bytes -= group.bytes;
        self.wait_for_slots(self.in_flight_max - 1);
        let objects = self.objects.clone();
        let placed = self.placed.clone();
        let overflow = self.overflow.clone();
        let (bucket, key) = (self.bucket.clone(), self.key.clone());
        let (version, block_size, persist) = (self.version, self.block_size, self.persist);
        self.in_flight.push_back(std::thread::spawn(move || {
            let upload = BlockUpload {
                objects: &objects,
                bucket: &bucket,
                key: &key,
                version,
                block_size,
                block_count: MORE_THAN_ONE_BLOCK,
                persist,
                placed: &placed,
                overflow: &overflow,
            };
            let slices: Vec<BlockSlice<'_>> = group
                .blocks
                .iter()
                .map(|(index, block)| BlockSlice {
                    index: *index,
                    data: block.as_ref(),
                })
                .collect();
            let outcome = upload.send(&group.address, &slices, STALE_EPOCH_RETRIES_MAX);
            drop(slices);
            (outcome, group.blocks)
        }));
    }
}

impl<B: AsRef<[u8]> + Send + 'static> Drop for StreamUpload<B> {
    /// An upload dropped before its commit frees what it sent.
    fn drop(&mut self) {
        self.abort();
    }
}
