//! The start-up self-test of what an engine can move: one test block written and read back.
//!
//! The server reports this figure (raised by the traffic it later samples) so the controller packs
//! jobs against what each server measured, not a nominal figure. The test works on the engine
//! directly, below the index, so it cannot meet a job's keys and leaves no record behind.

use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::engine::Engine;
use crate::error::StoreError;

/// Largest test block.
pub const THROUGHPUT_TEST_BYTES_MAX: u64 = 64 << 20;
/// Size of the pieces the test block is written and read in (the size of a DoPut batch).
pub const THROUGHPUT_TEST_PIECE_BYTES: u64 = 1 << 20;
/// Share of the capacity the test block may take, as a divisor.
const THROUGHPUT_TEST_CAPACITY_DIVISOR: u64 = 8;
/// The test repeats its pass until at least this long has gone by (and at least
/// `THROUGHPUT_TEST_PASSES_MIN` passes), keeping each direction's best: a burst of other work on
/// the host (servers starting beside it) must not stand for what the tier can move.
const THROUGHPUT_TEST_DURATION_MIN: Duration = Duration::from_millis(250);
/// Fewest passes of the test.
const THROUGHPUT_TEST_PASSES_MIN: u32 = 2;
/// Most passes of the test.
const THROUGHPUT_TEST_PASSES_MAX: u32 = 16;

/// What the self-test measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Throughput {
    /// Bytes of the test block.
    pub test_bytes: u64,
    /// Bytes written per second.
    pub write_bytes_per_s: u64,
    /// Bytes read back (and compared with what was written) per second.
    pub read_bytes_per_s: u64,
}

impl Throughput {
    /// The slower of the two directions.
    pub fn bytes_per_s(&self) -> u64 {
        self.write_bytes_per_s.min(self.read_bytes_per_s)
    }
}

/// The size of the test block on an engine of `capacity_bytes`: `min(64 MiB, capacity / 8)` in
/// whole pieces, or `None` below one piece.
pub fn test_bytes(capacity_bytes: u64) -> Option<u64> {
    let bytes = THROUGHPUT_TEST_BYTES_MAX.min(capacity_bytes / THROUGHPUT_TEST_CAPACITY_DIVISOR);
    let bytes = bytes / THROUGHPUT_TEST_PIECE_BYTES * THROUGHPUT_TEST_PIECE_BYTES;
    (bytes >= THROUGHPUT_TEST_PIECE_BYTES).then_some(bytes)
}

fn per_second(bytes: u64, elapsed: Duration) -> u64 {
    let secs = elapsed.as_secs_f64().max(1e-9);
    (bytes as f64 / secs).round() as u64
}

/// Write one test block through `engine` in 1 MiB pieces, read it back piece by piece comparing
/// each with what was written, and free it; repeated (see `THROUGHPUT_TEST_DURATION_MIN`), each
/// direction's best pass kept. `None` when the engine is too small for a test block.
///
/// Meant to run before the server serves: the block's extent is the engine's, not charged to the
/// store's budget, for the test's duration.
pub async fn measure(engine: &dyn Engine) -> Result<Option<Throughput>, StoreError> {
    let Some(len) = test_bytes(engine.capacity_bytes()) else {
        return Ok(None);
    };
    let piece: Bytes = (0..THROUGHPUT_TEST_PIECE_BYTES)
        .map(|i| (i.wrapping_mul(31) >> 3) as u8)
        .collect::<Vec<u8>>()
        .into();
    let started = Instant::now();
    let mut best = Throughput {
        test_bytes: len,
        write_bytes_per_s: 0,
        read_bytes_per_s: 0,
    };
    let mut passes = 0;
    while passes < THROUGHPUT_TEST_PASSES_MAX
        && (passes < THROUGHPUT_TEST_PASSES_MIN || started.elapsed() < THROUGHPUT_TEST_DURATION_MIN)
    {
        let (write, read) = measure_pass(engine, len, &piece).await?;
        best.write_bytes_per_s = best.write_bytes_per_s.max(write);
        best.read_bytes_per_s = best.read_bytes_per_s.max(read);
        passes += 1;
    }
    Ok(Some(best))
}

/// One pass: write the test block of `len` bytes in `piece`s, read it back, free it; returns
/// (write, read) bytes per second.
async fn measure_pass(
    engine: &dyn Engine,
    len: u64,
    piece: &Bytes,
) -> Result<(u64, u64), StoreError> {
    let pieces = len / THROUGHPUT_TEST_PIECE_BYTES;
    let started = Instant::now();
    let mut writer = engine.begin_write(len)?;
    for _ in 0..pieces {
        writer.append(piece.clone()).await?;
    }
    let block = writer.finish().await?;
    // The device's pace, not the staging memory's: the writes behind the handle count too (a
    // failed one surfaces as the typed error of the read below).
    let _ = block.written().await;
    let write_elapsed = started.elapsed();

    let started = Instant::now();
    for index in 0..pieces {
        let bytes = engine
            .read(
                &block,
                index * THROUGHPUT_TEST_PIECE_BYTES,
                THROUGHPUT_TEST_PIECE_BYTES,
            )
            .await?;
        // The comparison touches every byte, as sending them would; a mismatch is an engine bug.
        assert!(
            bytes == *piece,
            "test block piece {index} read back changed"
        );
    }
    let read_elapsed = started.elapsed();
    drop(block);
    Ok((
        per_second(len, write_elapsed),
        per_second(len, read_elapsed),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Tier;
    use crate::store::{Store, StoreConfig};

    fn open(tier: Tier, capacity_bytes: u64) -> (Store, Option<tempfile::TempDir>) {
        let dir = (tier == Tier::Nvme)
            .then(|| tempfile::tempdir_in("/tmp").expect("temp dir on an O_DIRECT file system"));
        let store = Store::open(StoreConfig {
            tier,
            capacity_bytes,
            nvme_path: dir.as_ref().map(|d| d.path().join("blocks")),
            ..Default::default()
        })
        .unwrap();
        (store, dir)
    }

    #[test]
    fn test_block_is_an_eighth_of_capacity_up_to_64_mib() {
        assert_eq!(test_bytes(1 << 30), Some(64 << 20));
        assert_eq!(test_bytes(80 << 20), Some(10 << 20));
        assert_eq!(test_bytes(12 << 20), Some(1 << 20));
        assert_eq!(test_bytes(8 << 20), Some(1 << 20));
        assert_eq!(test_bytes((8 << 20) - 1), None);
    }

    async fn measures_and_frees_everything(tier: Tier) {
        let (store, _dir) = open(tier, 64 << 20);
        store.create_bucket("job-a", "b").unwrap();
        let used_before = store.used_bytes();
        let engine_used_before = store.engine_used_bytes();
        let measured = store.measure_throughput().await.unwrap().unwrap();
        assert_eq!(measured.test_bytes, 8 << 20);
        assert!(measured.write_bytes_per_s > 0 && measured.read_bytes_per_s > 0);
        assert_eq!(
            measured.bytes_per_s(),
            measured.write_bytes_per_s.min(measured.read_bytes_per_s)
        );
        assert_eq!(store.used_bytes(), used_before);
        assert_eq!(store.engine_used_bytes(), engine_used_before);
        assert!(store.usage().per_job.keys().all(|job| job == "job-a"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dram_measures_and_frees_everything() {
        measures_and_frees_everything(Tier::Dram).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nvme_measures_and_frees_everything() {
        measures_and_frees_everything(Tier::Nvme).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn too_small_an_engine_is_not_measured() {
        for tier in [Tier::Dram, Tier::Nvme] {
            let (store, _dir) = open(tier, 4 << 20);
            assert_eq!(store.measure_throughput().await.unwrap(), None);
            assert_eq!(store.engine_used_bytes(), 0);
        }
    }
}
