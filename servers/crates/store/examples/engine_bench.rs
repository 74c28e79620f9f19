//! Engine benchmark: DRAM write/read throughput and NVMe sequential/random I/O, printed as JSON.
//!
//! Run with `cargo run --release -p pocketflow-store --example engine_bench -- [options]`;
//! `benchmarks/engines.py` runs it next to fio on the same file. Options:
//! `--nvme-file PATH` (omit to skip NVMe), `--nvme-bytes N` (default 1 GiB),
//! `--dram-bytes N` (default 512 MiB), `--threads N` (DRAM copy threads, default 2),
//! `--seconds S` per pattern (default 3), `--patterns LIST` (comma-separated, of `dram`,
//! `seqwrite`, `seqread`, `randread`; default all). An NVMe pattern may name its queue depth,
//! e.g. `seqread-qd1` (one I/O at a time, what a single client's get costs); the defaults are 8
//! for the sequential patterns and 32 for `randread`. The read patterns first fill the file with
//! an untimed write pass when no write pass ran before them in the same process.
//! `--serve` opens the NVMe engine once and then runs one pattern per line read from stdin,
//! printing one JSON line each, so a driver can alternate the engine with fio on the same file
//! without refilling it (the blocks' contents do not matter to the timings).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use pocketflow_store::engine::dram::DramEngine;
use pocketflow_store::engine::nvme::{NvmeConfig, NvmeEngine};
use pocketflow_store::{Engine, StoredBlock};

const MIB: u64 = 1024 * 1024;

struct Options {
    nvme_file: Option<String>,
    nvme_bytes: u64,
    dram_bytes: u64,
    threads: usize,
    seconds: f64,
    patterns: Vec<String>,
    serve: bool,
}

fn parse_options() -> Options {
    let mut options = Options {
        nvme_file: None,
        nvme_bytes: 1024 * MIB,
        dram_bytes: 512 * MIB,
        threads: 2,
        seconds: 3.0,
        patterns: vec![],
        serve: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || {
            args.next()
                .unwrap_or_else(|| panic!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--nvme-file" => options.nvme_file = Some(value()),
            "--nvme-bytes" => {
                options.nvme_bytes = value().parse().expect("--nvme-bytes is a byte count")
            }
            "--dram-bytes" => {
                options.dram_bytes = value().parse().expect("--dram-bytes is a byte count")
            }
            "--threads" => options.threads = value().parse().expect("--threads is a count"),
            "--seconds" => options.seconds = value().parse().expect("--seconds is a number"),
            "--serve" => options.serve = true,
            "--patterns" => options.patterns = value().split(',').map(str::to_string).collect(),
            other => panic!("unknown option {other}"),
        }
    }
    if options.patterns.is_empty() {
        options.patterns = ["dram", "seqwrite", "seqread", "randread"]
            .map(String::from)
            .to_vec();
    }
    options
}

/// Poll a future that is ready at once (the DRAM engine's futures never wait).
fn ready<F: std::future::Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("the DRAM engine never waits"),
    }
}

fn source(len: usize) -> Bytes {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect::<Vec<_>>()
        .into()
}

fn gbps(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e9
}

/// DRAM: each thread writes a batch of blocks (copy into the arena), then reads each back and
/// consumes it (copy out of the zero-copy `Bytes`), then frees the batch; repeated for `seconds`.
fn bench_dram(options: &Options, block_bytes: u64) -> serde_json::Value {
    let engine = Arc::new(DramEngine::open(options.dram_bytes, true).expect("dram arena"));
    let batch_bytes = options.dram_bytes / options.threads as u64 / 2;
    let batch_blocks = (batch_bytes / block_bytes).max(1) as usize;
    let deadline = Instant::now() + Duration::from_secs_f64(options.seconds);
    let write_nanos = AtomicU64::new(0);
    let read_nanos = AtomicU64::new(0);
    let bytes_moved = AtomicU64::new(0);
    let src = source(block_bytes as usize);
    std::thread::scope(|scope| {
        for _ in 0..options.threads {
            scope.spawn(|| {
                let mut sink = vec![0u8; block_bytes as usize];
                let mut blocks: Vec<StoredBlock> = Vec::with_capacity(batch_blocks);
                while Instant::now() < deadline {
                    let started = Instant::now();
                    for _ in 0..batch_blocks {
                        let mut writer = engine.begin_write(block_bytes).expect("arena has room");
                        ready(writer.append(src.clone())).expect("append");
                        blocks.push(ready(writer.finish()).expect("finish"));
                    }
                    let written = Instant::now();
                    for block in &blocks {
                        let bytes = ready(engine.read(block, 0, block_bytes)).expect("read");
                        sink.copy_from_slice(&bytes);
                    }
                    let read = Instant::now();
                    std::hint::black_box(&sink);
                    blocks.clear();
                    write_nanos.fetch_add((written - started).as_nanos() as u64, Ordering::Relaxed);
                    read_nanos.fetch_add((read - written).as_nanos() as u64, Ordering::Relaxed);
                    bytes_moved.fetch_add(batch_blocks as u64 * block_bytes, Ordering::Relaxed);
                }
            });
        }
    });
    // Per-thread time is summed, so divide by threads for the wall-clock equivalent.
    let threads = options.threads as u64;
    let bytes = bytes_moved.load(Ordering::Relaxed);
    let write = Duration::from_nanos(write_nanos.load(Ordering::Relaxed) / threads);
    let read = Duration::from_nanos(read_nanos.load(Ordering::Relaxed) / threads);
    serde_json::json!({
        "block_bytes": block_bytes,
        "threads": options.threads,
        "bytes": bytes,
        "write_gbps": gbps(bytes, write),
        "read_gbps": gbps(bytes, read),
        "write_read_gbps": gbps(2 * bytes, write + read),
    })
}

struct Measured {
    bytes: u64,
    ops: u64,
    elapsed: Duration,
}

impl Measured {
    fn json(&self, pattern: &str, block_bytes: u64, queue_depth: usize) -> serde_json::Value {
        serde_json::json!({
            "pattern": pattern,
            "block_bytes": block_bytes,
            "queue_depth": queue_depth,
            "bytes": self.bytes,
            "seconds": self.elapsed.as_secs_f64(),
            "gbps": gbps(self.bytes, self.elapsed),
            "iops": self.ops as f64 / self.elapsed.as_secs_f64(),
        })
    }
}

/// Write every 1 MiB block of the file in order with `queue_depth` blocks in flight, repeatedly
/// (freeing the previous pass first) until `seconds` pass; returns the last pass's blocks.
async fn nvme_seq_write(
    engine: &Arc<NvmeEngine>,
    blocks: usize,
    queue_depth: usize,
    seconds: f64,
) -> (Measured, Vec<StoredBlock>) {
    let src = source(MIB as usize);
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    let mut passes = 0u64;
    let mut last = Vec::new();
    while passes == 0 || Instant::now() < deadline {
        last.clear();
        let next = Arc::new(AtomicUsize::new(0));
        let slots: Arc<Vec<std::sync::Mutex<Option<StoredBlock>>>> =
            Arc::new((0..blocks).map(|_| Default::default()).collect());
        let tasks: Vec<_> = (0..queue_depth)
            .map(|_| {
                let (engine, next, slots, src) = (
                    Arc::clone(engine),
                    Arc::clone(&next),
                    Arc::clone(&slots),
                    src.clone(),
                );
                tokio::spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= slots.len() {
                            break;
                        }
                        let mut writer = engine.begin_write(MIB).expect("file has room");
                        writer.append(src.clone()).await.expect("append");
                        *slots[i].lock().unwrap() = Some(writer.finish().await.expect("finish"));
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        last = slots
            .iter()
            .map(|slot| slot.lock().unwrap().take().unwrap())
            .collect();
        passes += 1;
    }
    let elapsed = started.elapsed();
    (
        Measured {
            bytes: passes * blocks as u64 * MIB,
            ops: passes * blocks as u64,
            elapsed,
        },
        last,
    )
}

/// Read the blocks in order with `queue_depth` reads in flight, repeatedly, for `seconds`.
async fn nvme_seq_read(
    engine: &Arc<NvmeEngine>,
    blocks: &Arc<Vec<StoredBlock>>,
    queue_depth: usize,
    seconds: f64,
) -> Measured {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    let tasks: Vec<_> = (0..queue_depth)
        .map(|_| {
            let (engine, next, blocks) =
                (Arc::clone(engine), Arc::clone(&next), Arc::clone(blocks));
            tokio::spawn(async move {
                let mut ops = 0u64;
                while Instant::now() < deadline {
                    let block = &blocks[next.fetch_add(1, Ordering::Relaxed) % blocks.len()];
                    let bytes = engine.read(block, 0, MIB).await.expect("read");
                    assert_eq!(bytes.len() as u64, MIB);
                    ops += 1;
                }
                ops
            })
        })
        .collect();
    let mut ops = 0;
    for task in tasks {
        ops += task.await.unwrap();
    }
    Measured {
        bytes: ops * MIB,
        ops,
        elapsed: started.elapsed(),
    }
}

/// Read random aligned 64 KiB ranges of random blocks with `queue_depth` reads in flight.
async fn nvme_rand_read(
    engine: &Arc<NvmeEngine>,
    blocks: &Arc<Vec<StoredBlock>>,
    queue_depth: usize,
    seconds: f64,
) -> Measured {
    const READ_BYTES: u64 = 64 * 1024;
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    let tasks: Vec<_> = (0..queue_depth)
        .map(|task| {
            let (engine, blocks) = (Arc::clone(engine), Arc::clone(blocks));
            tokio::spawn(async move {
                let mut state =
                    0x2545_f491_4f6c_dd1du64 ^ (task as u64 + 1).wrapping_mul(0x9e37_79b9);
                let mut ops = 0u64;
                while Instant::now() < deadline {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let block = &blocks[(state % blocks.len() as u64) as usize];
                    let offset = (state >> 32) % (MIB / READ_BYTES) * READ_BYTES;
                    let bytes = engine.read(block, offset, READ_BYTES).await.expect("read");
                    assert_eq!(bytes.len() as u64, READ_BYTES);
                    ops += 1;
                }
                ops
            })
        })
        .collect();
    let mut ops = 0;
    for task in tasks {
        ops += task.await.unwrap();
    }
    Measured {
        bytes: ops * READ_BYTES,
        ops,
        elapsed: started.elapsed(),
    }
}

/// Runs NVMe patterns against one engine, keeping the last written blocks for reads.
struct NvmeBench {
    engine: Arc<NvmeEngine>,
    blocks: usize,
    seconds: f64,
    written: Option<Arc<Vec<StoredBlock>>>,
}

impl NvmeBench {
    fn open(options: &Options, path: &str) -> Self {
        let engine = Arc::new(
            NvmeEngine::open(NvmeConfig::new(path, options.nvme_bytes)).expect("nvme engine"),
        );
        let blocks = (engine.capacity_bytes() / MIB) as usize;
        Self {
            engine,
            blocks,
            seconds: options.seconds,
            written: None,
        }
    }

    async fn run(&mut self, pattern: &str) -> serde_json::Value {
        let (name, queue_depth) = nvme_pattern(pattern);
        if matches!(name, "seqread" | "randread") && self.written.is_none() {
            self.written = Some(Arc::new(
                nvme_seq_write(&self.engine, self.blocks, 8, 0.0).await.1,
            ));
        }
        match name {
            "seqwrite" => {
                drop(self.written.take()); // free the previous pass so the file has room
                let (measured, last) =
                    nvme_seq_write(&self.engine, self.blocks, queue_depth, self.seconds).await;
                self.written = Some(Arc::new(last));
                measured.json("write", MIB, queue_depth)
            }
            "seqread" => {
                let data = self.written.as_ref().expect("blocks written");
                nvme_seq_read(&self.engine, data, queue_depth, self.seconds)
                    .await
                    .json("read", MIB, queue_depth)
            }
            "randread" => {
                let data = self.written.as_ref().expect("blocks written");
                nvme_rand_read(&self.engine, data, queue_depth, self.seconds)
                    .await
                    .json("randread", 64 * 1024, queue_depth)
            }
            other => panic!("unknown nvme pattern {other}"),
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

const NVME_PATTERNS: [&str; 3] = ["seqwrite", "seqread", "randread"];
/// Most I/Os a pattern may keep in flight (one task each).
const PATTERN_QUEUE_DEPTH_MAX: usize = 1024;

/// Split `seqread-qd1` into the pattern name and its queue depth (the pattern's default if the
/// suffix is absent); panics on an unknown name or a depth outside 1..=1024.
fn nvme_pattern(pattern: &str) -> (&str, usize) {
    let (name, depth) = match pattern.split_once("-qd") {
        Some((name, depth)) => (name, Some(depth)),
        None => (pattern, None),
    };
    assert!(
        NVME_PATTERNS.contains(&name),
        "unknown nvme pattern {pattern}"
    );
    let default_depth = if name == "randread" { 32 } else { 8 };
    let depth = depth.map_or(default_depth, |d| {
        d.parse().expect("the -qd suffix is a queue depth")
    });
    assert!(
        (1..=PATTERN_QUEUE_DEPTH_MAX).contains(&depth),
        "queue depth {depth} of {pattern} is not within 1..={PATTERN_QUEUE_DEPTH_MAX}"
    );
    (name, depth)
}

fn main() {
    let options = parse_options();
    if options.serve {
        let path = options
            .nvme_file
            .as_deref()
            .expect("--serve needs --nvme-file");
        let runtime = runtime();
        let mut bench = runtime.block_on(async { NvmeBench::open(&options, path) });
        for line in std::io::stdin().lines() {
            let pattern = line.expect("stdin");
            let result = runtime.block_on(bench.run(pattern.trim()));
            println!("{}", serde_json::json!({ pattern.trim(): result }));
        }
        return;
    }
    for pattern in &options.patterns {
        if pattern != "dram" {
            nvme_pattern(pattern);
        }
    }
    let mut report = serde_json::Map::new();
    if options.patterns.iter().any(|p| p == "dram") {
        let dram: Vec<serde_json::Value> = [64 * 1024, MIB]
            .iter()
            .map(|&block| bench_dram(&options, block))
            .collect();
        report.insert("dram".into(), dram.into());
    }
    let nvme_patterns: Vec<&String> = options
        .patterns
        .iter()
        .filter(|p| p.as_str() != "dram")
        .collect();
    if !nvme_patterns.is_empty() {
        let path = options
            .nvme_file
            .as_deref()
            .expect("nvme patterns need --nvme-file");
        let runtime = runtime();
        let nvme = runtime.block_on(async {
            let mut bench = NvmeBench::open(&options, path);
            let mut nvme = serde_json::Map::new();
            nvme.insert("file".into(), path.into());
            nvme.insert("file_bytes".into(), bench.engine.capacity_bytes().into());
            for pattern in nvme_patterns {
                nvme.insert(pattern.clone(), bench.run(pattern).await);
            }
            nvme
        });
        report.insert("nvme".into(), nvme.into());
    }
    println!("{}", serde_json::to_string_pretty(&report).expect("json"));
}
