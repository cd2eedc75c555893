//! How long the Step program's collectives take on the GPU, and how much of that the step
//! waits for.
//!
//! Timing events mark the step's start, each collective's start and end on the stream it runs
//! on, and each point where the step's stream waits for side collectives (a launch that reads
//! their results, the end of the program). Inside a CUDA graph's capture they are recorded as
//! event nodes (`CU_EVENT_RECORD_EXTERNAL`), so every replay records them. After a run:
//! *busy* is the sum of the collectives' spans; *exposed* is the time the step's stream spends
//! at its wait points before what it waits for is done (overlapping waits counted once); the
//! rest of busy is *hidden* behind the backward. Collectives on the step's stream
//! (`--no-comm-overlap`, profiled runs) are exposed whole.

use std::collections::HashMap;

use cudarc::driver::sys;

use super::device::ck;
use super::launch::{Launch, Step};
use crate::executor::CommTimes;

/// The timing events of the Step program's collectives and what they measured so far.
pub(super) struct CommTiming {
    /// Recorded on the step's stream before its first launch: every time is from here.
    zero: sys::CUevent,
    /// Per collective launch: [started, done], on the stream it runs on.
    spans: HashMap<usize, [sys::CUevent; 2]>,
    /// Per wait point (a launch index; the number of launches for the program's end): recorded
    /// on the step's stream before it waits.
    marks: HashMap<usize, sys::CUevent>,
    /// Sums over the measured runs (the first run, with its capture, is left out).
    totals: CommTimes,
    runs: u32,
    /// Why the events could not be read, once they could not.
    failed: Option<String>,
}

fn timing_event() -> Result<sys::CUevent, String> {
    cudarc::driver::result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| format!("event: {e:?}"))
}

/// Records `ev` on `stream`: as an event node when the stream is being captured.
///
/// # Safety
/// `ev` and `stream` belong to the current context.
pub(super) unsafe fn record(ev: sys::CUevent, stream: sys::CUstream) -> Result<(), String> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    ck(sys::cuStreamIsCapturing(stream, &mut status), "capture status")?;
    let flags = match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL,
        _ => sys::CUevent_record_flags::CU_EVENT_RECORD_DEFAULT,
    };
    ck(sys::cuEventRecordWithFlags(ev, stream, flags as u32), "timing event")
}

/// The wait points of a run of `launches`: (mark index, the side collectives it waits for), in
/// launch order, as [`super::CudaExecutor::launch`] makes them when collectives run `beside`.
fn wait_points(launches: &[Launch], beside: bool) -> Vec<(usize, Vec<usize>)> {
    let mut pending: Vec<usize> = vec![];
    let mut points = vec![];
    for (i, l) in launches.iter().enumerate() {
        let waited: Vec<usize> = l.waits.iter().copied().filter(|j| pending.contains(j)).collect();
        pending.retain(|j| !waited.contains(j));
        if !waited.is_empty() {
            points.push((i, waited));
        }
        if beside && l.side {
            pending.push(i);
        }
    }
    if !pending.is_empty() {
        points.push((launches.len(), pending));
    }
    points
}

/// Exposed milliseconds: at each wait point (its time, the end times of what it waits for) the
/// step's stream stands still from the later of its arrival and the last exposure counted until
/// the last collective it waits for is done.
fn exposed_ms(points: &[(f32, Vec<f32>)]) -> f32 {
    let (mut covered, mut exposed) = (0f32, 0f32);
    for (at, done) in points {
        let end = done.iter().copied().fold(f32::MIN, f32::max);
        let from = at.max(covered);
        if end > from {
            exposed += end - from;
            covered = end;
        }
    }
    exposed
}

impl CommTiming {
    /// Events for every collective and wait point of the Step program's `launches`.
    pub(super) fn new(launches: &[Launch]) -> Result<CommTiming, String> {
        let mut t = CommTiming { zero: timing_event()?, spans: HashMap::new(), marks: HashMap::new(), totals: CommTimes::default(), runs: 0, failed: None };
        for (i, l) in launches.iter().enumerate() {
            if l.steps.iter().any(|s| matches!(s, Step::Collective { .. })) {
                t.spans.insert(i, [timing_event()?, timing_event()?]);
            }
            if !l.waits.is_empty() {
                t.marks.insert(i, timing_event()?);
            }
        }
        t.marks.insert(launches.len(), timing_event()?);
        Ok(t)
    }

    /// The event recorded before launch `i` starts the run (`i == 0`).
    pub(super) fn zero(&self, i: usize) -> Option<sys::CUevent> {
        (i == 0).then_some(self.zero)
    }

    /// Collective launch `i`'s [started, done] events.
    pub(super) fn span(&self, i: usize) -> Option<[sys::CUevent; 2]> {
        self.spans.get(&i).copied()
    }

    /// The event of wait point `i`.
    pub(super) fn mark(&self, i: usize) -> Option<sys::CUevent> {
        self.marks.get(&i).copied()
    }

    /// Reads a finished run's events (`beside`: whether side collectives ran beside the step)
    /// and adds them to the totals; a failure to read them ends the measurement, not the run.
    pub(super) fn measure(&mut self, launches: &[Launch], beside: bool) {
        self.runs += 1;
        if self.runs == 1 || self.failed.is_some() {
            return;
        }
        let at = |ev: sys::CUevent| -> Result<f32, String> {
            // SAFETY: both events were recorded in this run, which has finished.
            unsafe { cudarc::driver::result::event::elapsed(self.zero, ev) }.map_err(|e| format!("{e:?}"))
        };
        let run = || -> Result<(f32, f32), String> {
            let (mut busy, mut inline) = (0f32, 0f32);
            let mut done = HashMap::new();
            for (&i, &[s, d]) in &self.spans {
                let (s, d) = (at(s)?, at(d)?);
                busy += d - s;
                // One that ran on the step's stream held it up whole.
                if !(beside && launches[i].side) {
                    inline += d - s;
                }
                done.insert(i, d);
            }
            let mut points = vec![];
            for (mark, waited) in wait_points(launches, beside) {
                let ev = self.marks.get(&mark).ok_or("a wait point without its event")?;
                points.push((at(*ev)?, waited.iter().map(|j| done.get(j).copied().unwrap_or(0.0)).collect()));
            }
            Ok((busy, (inline + exposed_ms(&points)).min(busy)))
        };
        match run() {
            Ok((busy, exposed)) => {
                self.totals.steps += 1;
                self.totals.busy_ms += busy as f64;
                self.totals.exposed_ms += exposed as f64;
            }
            Err(e) => self.failed = Some(e),
        }
    }

    /// What was measured (`Err`: why nothing could be).
    pub(super) fn times(&self) -> Result<CommTimes, String> {
        match &self.failed {
            Some(e) => Err(format!("the timing events could not be read: {e}")),
            None => Ok(self.totals),
        }
    }
}

impl Drop for CommTiming {
    fn drop(&mut self) {
        // SAFETY: created in `new`; the executor synchronizes after every run.
        unsafe {
            let _ = sys::cuEventDestroy_v2(self.zero);
            for ev in self.spans.values().flatten().chain(self.marks.values()) {
                let _ = sys::cuEventDestroy_v2(*ev);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::exposed_ms;

    #[test]
    fn exposure_counts_only_the_waits_past_the_collectives_end() {
        // Done before the reader comes: hidden.
        assert_eq!(exposed_ms(&[(10.0, vec![4.0, 8.0])]), 0.0);
        // The reader waits from 10 to 12.
        assert_eq!(exposed_ms(&[(10.0, vec![4.0, 12.0])]), 2.0);
        // Two wait points: 10..12, then the end waits 12..13 (not again from 11).
        assert_eq!(exposed_ms(&[(10.0, vec![12.0]), (11.0, vec![13.0])]), 3.0);
        // The second point comes after the first wait ended.
        assert_eq!(exposed_ms(&[(10.0, vec![12.0]), (20.0, vec![19.0])]), 2.0);
    }
}
