//! Listing a bucket: every server of the job is asked for its keys under a prefix, in pages, and
//! the sorted answers are merged into pages of the whole bucket (a key held on two servers, as
//! after a job's map changed, is listed once).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use pocketflow_protocol::action::{ActionName, EnumerateRequest, EnumerateResult, KeyEntry};
use tonic::Code;

use crate::error::ClientError;
use crate::failure::{body, server_error, Failure};
use crate::objects::{Objects, STALE_EPOCH_RETRIES_MAX};
use crate::parallel::run_parallel;

/// One server's part of a listing: the keys it sent that are not merged yet, and whether it has
/// more after them.
struct Part {
    address: String,
    keys: VecDeque<KeyEntry>,
    more: bool,
}

/// A listing in progress (see the module doc); [`Listing::next_page`] gives its pages in key
/// order. Each server's keys are fetched a page at a time, so memory stays within one page per
/// server.
pub struct Listing {
    objects: Arc<Objects>,
    bucket: String,
    prefix: String,
    page_size: u32,
    parts: Vec<Part>,
    /// `(next key, part)` of every part that has a key buffered.
    heap: BinaryHeap<Reverse<(String, usize)>>,
    last_key: Option<String>,
}

impl Objects {
    /// One page of `bucket`'s keys under `prefix` after `start_after` from the server at
    /// `address`; `None` when the server does not have the bucket.
    fn enumerate_on(
        &self,
        address: &str,
        bucket: &str,
        prefix: &str,
        start_after: Option<&str>,
        limit: u32,
    ) -> Result<Option<EnumerateResult>, Failure> {
        for attempt in 0..=STALE_EPOCH_RETRIES_MAX {
            let view = self.view();
            let request = EnumerateRequest {
                ctx: view.ctx.clone(),
                bucket: bucket.to_string(),
                prefix: prefix.to_string(),
                start_after: start_after.map(str::to_string),
                limit,
            };
            let outcome = self.action(address, ActionName::Enumerate, body(&request));
            match outcome {
                Ok(answer) => {
                    return serde_json::from_slice(&answer).map(Some).map_err(|e| {
                        Failure::at(
                            ClientError::Protocol(format!("enumerate answer: {e}")),
                            address,
                        )
                    })
                }
                Err(error)
                    if matches!(&error, ClientError::Server { message, .. }
                        if message.starts_with("bucket_not_found: ")) =>
                {
                    return Ok(None)
                }
                Err(error) if error.is_stale_epoch() => {
                    self.adopt_or_fail(Failure::at(error, address), attempt)?;
                }
                Err(error) => return Err(Failure::at(error, address)),
            }
        }
        unreachable!("the last attempt returns")
    }
}

impl Listing {
    /// Start listing `bucket` under `prefix` in pages of `page_size` keys: the first page of
    /// every server, servers in parallel. Fails as `bucket_not_found` if no server has the
    /// bucket.
    pub fn start(
        objects: Arc<Objects>,
        bucket: &str,
        prefix: &str,
        page_size: u32,
    ) -> Result<Listing, Failure> {
        let view = objects.view();
        let mut addresses: Vec<&str> = Vec::new();
        for server in &view.servers {
            if !addresses.contains(&server.address.as_str()) {
                addresses.push(&server.address);
            }
        }
        let first = run_parallel(&addresses, addresses.len(), |address| {
            objects.enumerate_on(address, bucket, prefix, None, page_size)
        });
        let mut parts = Vec::with_capacity(first.len());
        let mut any_bucket = false;
        for (address, answer) in addresses.iter().zip(first) {
            let answer = answer?;
            any_bucket |= answer.is_some();
            let (keys, truncated) = answer.map_or((Vec::new(), false), |a| (a.keys, a.truncated));
            parts.push(Part {
                address: address.to_string(),
                more: truncated && !keys.is_empty(),
                keys: keys.into(),
            });
        }
        if !addresses.is_empty() && !any_bucket {
            return Err(Failure::at(
                server_error(
                    Code::NotFound as i32,
                    "bucket_not_found",
                    bucket.to_string(),
                ),
                "",
            ));
        }
        let heap = parts
            .iter()
            .enumerate()
            .filter_map(|(slot, part)| part.keys.front().map(|e| Reverse((e.key.clone(), slot))))
            .collect();
        Ok(Listing {
            objects,
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
            page_size,
            parts,
            heap,
            last_key: None,
        })
    }

    /// The next page, `(key, size)` in key order; `None` once every key was listed.
    pub fn next_page(&mut self) -> Result<Option<Vec<(String, u64)>>, Failure> {
        let mut page = Vec::new();
        while let Some(Reverse((key, slot))) = self.heap.pop() {
            let part = &mut self.parts[slot];
            let entry = part.keys.pop_front().expect("a part in the heap has a key");
            if part.keys.is_empty() && part.more {
                let answer = self.objects.enumerate_on(
                    &part.address,
                    &self.bucket,
                    &self.prefix,
                    Some(&entry.key),
                    self.page_size,
                )?;
                let (keys, truncated) =
                    answer.map_or((Vec::new(), false), |a| (a.keys, a.truncated));
                part.more = truncated && !keys.is_empty();
                part.keys = keys.into();
            }
            if let Some(next) = part.keys.front() {
                self.heap.push(Reverse((next.key.clone(), slot)));
            }
            if self.last_key.as_deref() != Some(key.as_str()) {
                self.last_key = Some(key);
                page.push((entry.key, entry.size));
                if page.len() == self.page_size as usize {
                    return Ok(Some(page));
                }
            }
        }
        Ok(if page.is_empty() { None } else { Some(page) })
    }
}
