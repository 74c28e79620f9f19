//! CLOCK_MONOTONIC in nanoseconds: the clock Python's `time.clock_gettime_ns(CLOCK_MONOTONIC)`
//! reads, so phases timed here line up with the benchmark's other client processes.

use std::time::Duration;

/// Nanoseconds on the machine-wide monotonic clock.
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec and CLOCK_MONOTONIC always exists on Linux.
    let status = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    assert_eq!(status, 0, "clock_gettime(CLOCK_MONOTONIC) failed");
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// Sleep until the monotonic clock reads `deadline_ns` (at once if it already has).
pub fn sleep_until(deadline_ns: u64) {
    let now = monotonic_ns();
    if deadline_ns > now {
        std::thread::sleep(Duration::from_nanos(deadline_ns - now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_moves_forward_and_sleep_until_waits() {
        let start = monotonic_ns();
        sleep_until(start + 2_000_000);
        assert!(monotonic_ns() >= start + 2_000_000);
        sleep_until(0); // in the past: returns at once
    }
}
