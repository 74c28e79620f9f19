//! Traffic counters and the sampler task that turns them, with process CPU time, into the rates
//! reported by the `stats` action.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Counters bumped by the request paths; read and reset by the sampler.
#[derive(Debug, Default)]
pub struct Counters {
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    ops: AtomicU64,
    bytes_in_total: AtomicU64,
    bytes_out_total: AtomicU64,
}

impl Counters {
    /// Count `n` received value bytes.
    pub fn add_in(&self, n: u64) {
        self.bytes_in.fetch_add(n, Ordering::Relaxed);
        self.bytes_in_total.fetch_add(n, Ordering::Relaxed);
    }

    /// Count `n` sent value bytes.
    pub fn add_out(&self, n: u64) {
        self.bytes_out.fetch_add(n, Ordering::Relaxed);
        self.bytes_out_total.fetch_add(n, Ordering::Relaxed);
    }

    /// Value bytes received and sent since the server started: `(in, out)`.
    pub fn totals(&self) -> (u64, u64) {
        (
            self.bytes_in_total.load(Ordering::Relaxed),
            self.bytes_out_total.load(Ordering::Relaxed),
        )
    }

    /// Count `n` operations.
    pub fn add_ops(&self, n: u64) {
        self.ops.fetch_add(n, Ordering::Relaxed);
    }

    fn take(&self) -> (u64, u64, u64) {
        (
            self.bytes_in.swap(0, Ordering::Relaxed),
            self.bytes_out.swap(0, Ordering::Relaxed),
            self.ops.swap(0, Ordering::Relaxed),
        )
    }
}

/// Rates over the last complete sampling interval.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sample {
    /// Length of the interval.
    pub interval_ms: u64,
    /// Process CPU time over wall time (1.0 = one core busy).
    pub cpu_utilization: f64,
    /// Value bytes received per second.
    pub bytes_in_per_s: u64,
    /// Value bytes sent per second.
    pub bytes_out_per_s: u64,
    /// Operations per second.
    pub ops_per_s: u64,
}

/// The counters, the last sample and the throughput the server has shown it can move.
#[derive(Debug, Default)]
pub struct Stats {
    /// Counters of the current interval.
    pub counters: Counters,
    last: Mutex<Sample>,
    /// The start-up self-test's figure, raised by the busiest sample since (bytes in plus out).
    throughput_bytes_per_s: AtomicU64,
}

/// User plus system CPU time of this process.
fn process_cpu_time() -> Duration {
    // SAFETY: getrusage writes into the zeroed struct we own and has no other effect.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
            return Duration::ZERO;
        }
        usage
    };
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, (t.tv_usec as u32) * 1000);
    time(usage.ru_utime) + time(usage.ru_stime)
}

fn per_second(count: u64, wall: Duration) -> u64 {
    if wall.is_zero() {
        return 0;
    }
    (count as f64 / wall.as_secs_f64()).round() as u64
}

impl Stats {
    /// The last complete sample (zeros before the first interval ends).
    pub fn last(&self) -> Sample {
        *self.last.lock().expect("stats lock")
    }

    /// Bytes per second the server can move: the larger of the self-test's figure
    /// ([`Stats::set_measured_throughput`]) and the busiest sample's bytes in plus out.
    pub fn throughput_bytes_per_s(&self) -> u64 {
        self.throughput_bytes_per_s.load(Ordering::Relaxed)
    }

    /// Record the start-up self-test's figure (bytes per second).
    pub fn set_measured_throughput(&self, bytes_per_s: u64) {
        self.throughput_bytes_per_s
            .fetch_max(bytes_per_s, Ordering::Relaxed);
    }

    /// Sample forever, every `interval`.
    pub async fn run_sampler(&self, interval: Duration) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        let mut wall_start = Instant::now();
        let mut cpu_start = process_cpu_time();
        self.counters.take();
        loop {
            ticker.tick().await;
            let (wall_end, cpu_end) = (Instant::now(), process_cpu_time());
            let (bytes_in, bytes_out, ops) = self.counters.take();
            let wall = wall_end - wall_start;
            let cpu = cpu_end.saturating_sub(cpu_start);
            let sample = Sample {
                interval_ms: wall.as_millis() as u64,
                cpu_utilization: if wall.is_zero() {
                    0.0
                } else {
                    cpu.as_secs_f64() / wall.as_secs_f64()
                },
                bytes_in_per_s: per_second(bytes_in, wall),
                bytes_out_per_s: per_second(bytes_out, wall),
                ops_per_s: per_second(ops, wall),
            };
            *self.last.lock().expect("stats lock") = sample;
            // A server that moved this much can move it: the figure only rises.
            self.set_measured_throughput(
                sample.bytes_in_per_s.saturating_add(sample.bytes_out_per_s),
            );
            (wall_start, cpu_start) = (wall_end, cpu_end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn sampler_reports_rates() {
        let stats = std::sync::Arc::new(Stats::default());
        let sampler = tokio::spawn({
            let stats = stats.clone();
            async move { stats.run_sampler(Duration::from_millis(1000)).await }
        });
        tokio::task::yield_now().await;
        stats.counters.add_in(4000);
        stats.counters.add_out(2000);
        stats.counters.add_ops(10);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let sample = stats.last();
        assert!(sample.interval_ms >= 1000, "{sample:?}");
        assert!(
            sample.bytes_in_per_s > 0 && sample.bytes_in_per_s <= 4000,
            "{sample:?}"
        );
        assert!(sample.ops_per_s > 0, "{sample:?}");
        assert_eq!(
            stats.throughput_bytes_per_s(),
            sample.bytes_in_per_s + sample.bytes_out_per_s
        );
        sampler.abort();
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn throughput_is_the_larger_of_the_self_test_and_the_busiest_sample() {
        let stats = std::sync::Arc::new(Stats::default());
        stats.set_measured_throughput(1500);
        let sampler = tokio::spawn({
            let stats = stats.clone();
            async move { stats.run_sampler(Duration::from_millis(1000)).await }
        });
        tokio::task::yield_now().await;
        stats.counters.add_in(500);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(stats.throughput_bytes_per_s(), 1500, "{:?}", stats.last());
        stats.counters.add_in(2000);
        stats.counters.add_out(1000);
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(stats.throughput_bytes_per_s(), 3000, "{:?}", stats.last());
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(stats.last().bytes_in_per_s, 0);
        assert_eq!(stats.throughput_bytes_per_s(), 3000);
        sampler.abort();
    }

    #[test]
    fn cpu_time_moves() {
        let before = process_cpu_time();
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(process_cpu_time() >= before);
    }
}
