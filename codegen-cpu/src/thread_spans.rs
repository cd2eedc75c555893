//! Where each thread of the CPU target spent a launch, for `fusec run --trace`: while recording
//! is on, every parallel task widens its thread's span (earliest start, latest end); the
//! executor takes the spans after each launch of the traced step, one per busy thread. Off, a
//! task costs one relaxed load.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Slots: rayon worker `k` records in slot `k` (the last ones shared past that); the last slot
/// is a thread outside the pools (the executor's own, running a task inline).
pub const SLOTS: usize = 256;

static ON: AtomicBool = AtomicBool::new(false);
static FIRST: [AtomicU64; SLOTS] = [const { AtomicU64::new(u64::MAX) }; SLOTS];
static LAST: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];

fn zero() -> Instant {
    static ZERO: OnceLock<Instant> = OnceLock::new();
    *ZERO.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    zero().elapsed().as_nanos() as u64
}

/// The slot of the calling thread.
pub fn slot() -> usize {
    rayon::current_thread_index().map_or(SLOTS - 1, |k| k.min(SLOTS - 2))
}

/// Runs task `f`, widening this thread's span while recording is on.
#[inline]
pub fn task<R>(f: impl FnOnce() -> R) -> R {
    if !ON.load(Relaxed) {
        return f();
    }
    let t0 = now_ns();
    let r = f();
    let s = slot();
    FIRST[s].fetch_min(t0, Relaxed);
    LAST[s].fetch_max(now_ns(), Relaxed);
    r
}

/// Clears the spans and starts recording.
pub fn start() {
    for s in 0..SLOTS {
        FIRST[s].store(u64::MAX, Relaxed);
        LAST[s].store(0, Relaxed);
    }
    zero();
    ON.store(true, Relaxed);
}

/// Stops recording; each busy slot's span as (slot, start after `since`, duration).
pub fn take(since: Instant) -> Vec<(usize, Duration, Duration)> {
    ON.store(false, Relaxed);
    let base = since.saturating_duration_since(zero()).as_nanos() as u64;
    (0..SLOTS)
        .filter_map(|s| {
            let (a, b) = (FIRST[s].load(Relaxed), LAST[s].load(Relaxed));
            (a <= b).then(|| (s, Duration::from_nanos(a.saturating_sub(base)), Duration::from_nanos(b - a)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_threads_report_their_spans() {
        let t0 = Instant::now();
        start();
        rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap().install(|| {
            rayon::join(|| task(|| std::thread::sleep(Duration::from_millis(5))), || task(|| std::thread::sleep(Duration::from_millis(5))))
        });
        let spans = take(t0);
        // Other tests' tasks may widen other slots meanwhile: look for this pool's.
        assert!(spans.iter().any(|&(s, _, d)| s < 2 && d >= Duration::from_millis(5)), "{spans:?}");
        assert!(!ON.load(Relaxed));
    }
}
