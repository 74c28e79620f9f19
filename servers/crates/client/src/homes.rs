//! Where a key's blocks live under one weight map: the home of block 0 and of each data block,
//! or the typed reason there is none (no server with weight, no long-running server).

use tonic::Code;

use crate::error::ClientError;
use crate::failure::{server_error, Failure};
use crate::placement::placed_block;
use crate::view::{Server, View};

/// The home of block `block` of `key`, or the typed reason there is none.
pub(crate) fn home<'v>(
    view: &'v View,
    key: &[u8],
    block: u32,
    persist: bool,
) -> Result<&'v Server, Failure> {
    view.server_for(key, block, persist).ok_or_else(|| {
        let error = if persist {
            server_error(
                Code::FailedPrecondition as i32,
                "persist_refused",
                "the job's weight map has no long-running server".into(),
            )
        } else {
            ClientError::Unavailable("the job's weight map has no server with weight > 0".into())
        };
        Failure::local(error)
    })
}

/// The home of data block `block` of an object of `block_count` data blocks (any count above
/// one for a streamed upload that knows no more): where placement puts
/// `(key, placed_block(block, block_count))`, so an object of one data block lives whole on its
/// manifest's home. Every path that writes, reads or frees a data block asks this.
pub(crate) fn block_home<'v>(
    view: &'v View,
    key: &[u8],
    block: u32,
    block_count: u32,
    persist: bool,
) -> Result<&'v Server, Failure> {
    home(view, key, placed_block(block, block_count), persist)
}
