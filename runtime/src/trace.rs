//! Timelines in the Chrome trace-event format (`fusec run --trace`), which Perfetto's UI and
//! `chrome://tracing` open: `{"traceEvents": [...], "displayTimeUnit": "ms"}` with one
//! process, one thread per [`Track`] (named by `"ph": "M"` metadata events, in the tracks'
//! order) and one `"ph": "X"` complete event per [`Slice`], `ts` and `dur` in microseconds
//! (fractions keep nanoseconds). Times are never negative: Perfetto drops such events.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Map, Value};

use crate::atomic::write_atomic;
use crate::file_error::FileError;
use crate::profile::{StepTrace, TracedLaunch};

/// One slice of a track: a named span with arguments that the viewer shows on selection.
#[derive(Clone, Debug)]
pub struct Slice {
    /// What ran (a pass, a kernel).
    pub name: String,
    /// The event category (`compile`, `launch`).
    pub cat: &'static str,
    /// Start, from the timeline's zero.
    pub start: Duration,
    /// Length.
    pub dur: Duration,
    /// Shown with the slice.
    pub args: Map<String, Value>,
}

/// A named track: a thread of the timeline's process. Its slices should not overlap.
#[derive(Clone, Debug)]
pub struct Track {
    /// The thread name the viewer shows.
    pub name: String,
    /// The slices, in time order.
    pub slices: Vec<Slice>,
}

/// A timeline of one process: its tracks and what the file says about the run.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    /// The process name the viewer shows.
    pub process: String,
    /// The tracks, top to bottom.
    pub tracks: Vec<Track>,
    /// Written as the file's `otherData` (the run's settings).
    pub about: Map<String, Value>,
}

/// The map of a JSON object (`json!({...})` for a slice's arguments); empty for other values.
pub fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

/// Microseconds, with the nanoseconds as fractions.
fn us(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1e3
}

impl Timeline {
    /// The trace-event JSON.
    pub fn to_json(&self) -> String {
        const PID: u32 = 1;
        let mut events = vec![json!({"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "args": {"name": self.process}})];
        for (i, t) in self.tracks.iter().enumerate() {
            let tid = i + 1;
            events.push(json!({"ph": "M", "name": "thread_name", "pid": PID, "tid": tid, "args": {"name": t.name}}));
            events.push(json!({"ph": "M", "name": "thread_sort_index", "pid": PID, "tid": tid, "args": {"sort_index": tid}}));
            for s in &t.slices {
                events.push(json!({
                    "ph": "X", "name": s.name, "cat": s.cat, "pid": PID, "tid": tid,
                    "ts": us(s.start), "dur": us(s.dur), "args": s.args,
                }));
            }
        }
        let file = json!({"traceEvents": events, "displayTimeUnit": "ms", "otherData": self.about});
        serde_json::to_string(&file).expect("a JSON value always prints") + "\n"
    }

    /// Writes the JSON to `path` atomically (a temporary file renamed over it: never torn).
    pub fn write(&self, path: &Path) -> Result<(), FileError> {
        write_atomic(path, |f| f.write(self.to_json().as_bytes()))
    }

    /// Slices in all tracks.
    pub fn slices(&self) -> usize {
        self.tracks.iter().map(|t| t.slices.len()).sum()
    }
}

/// The track of a traced step's launches that `keep` selects, the step starting `at` after the
/// timeline's zero. Each slice has the launch's name and, as arguments, its program, static
/// bytes and FLOPs, IR ops, and its start within the step (`in_step_us`; the first launch's is 0).
pub fn launch_track(name: String, step: &StepTrace, at: Duration, keep: impl Fn(&TracedLaunch) -> bool) -> Track {
    let slices = step.launches.iter().filter(|l| keep(l)).map(|l| Slice { name: l.name.clone(), cat: "launch", start: at + l.start, dur: l.dur, args: launch_args(l) }).collect();
    Track { name, slices }
}

fn launch_args(l: &TracedLaunch) -> serde_json::Map<String, serde_json::Value> {
    object(json!({
        "program": format!("{:?}", l.program),
        "bytes": l.bytes,
        "flops": l.flops,
        "ops": l.ops,
        "in_step_us": us(l.start),
    }))
}

/// One track per CPU thread that worked in the traced step: a slice per launch it took part in,
/// from its first task's start to its last task's end, named and described as the launch.
pub fn thread_tracks(step: &StepTrace, at: Duration) -> Vec<Track> {
    let mut slots: Vec<usize> = step.launches.iter().flat_map(|l| l.threads.iter().map(|t| t.0)).collect();
    slots.sort_unstable();
    slots.dedup();
    slots
        .into_iter()
        .map(|k| Track {
            name: match k {
                k if k == fusec_codegen_cpu::thread_spans::SLOTS - 1 => "executor thread (tasks run inline)".to_string(),
                k => format!("CPU worker {k}"),
            },
            slices: step
                .launches
                .iter()
                .flat_map(|l| l.threads.iter().filter(move |t| t.0 == k).map(move |&(_, s, d)| Slice { name: l.name.clone(), cat: "thread", start: at + s, dur: d, args: launch_args(l) }))
                .collect(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{Profile, Timed};
    use crate::programs::Program;

    #[test]
    fn the_json_has_named_tracks_and_complete_events_in_microseconds() {
        let mut p = Profile::tracing(false);
        for _ in 0..2 {
            if p.begin(Program::Step) {
                let ms = Duration::from_millis;
                p.record(Timed { name: "gemm_bias", bytes: 64, flops: 512, ops: &["matmul", "add bias"], start: ms(0), dur: ms(2), threads: &[(0, ms(0), ms(2)), (1, ms(1), ms(1))] });
                p.record(Timed { name: "add\"q", bytes: 8, flops: 0, ops: &["add"], start: ms(3), dur: Duration::from_nanos(1500), threads: &[] });
            }
        }
        let compile =
            Slice { name: "autodiff".into(), cat: "compile", start: Duration::ZERO, dur: Duration::from_micros(7), args: Map::new() };
        let t = Timeline {
            process: "fusec run".into(),
            tracks: vec![
                Track { name: "compile".into(), slices: vec![compile] },
                launch_track("executor thread".into(), p.trace().unwrap(), Duration::from_millis(10), |_| true),
            ],
            about: Map::new(),
        };
        assert_eq!(t.slices(), 3);
        let v: Value = serde_json::from_str(&t.to_json()).unwrap();
        assert_eq!(v["displayTimeUnit"], "ms");
        let ev = v["traceEvents"].as_array().unwrap();
        let names: Vec<&str> = ev.iter().filter(|e| e["name"] == "thread_name").map(|e| e["args"]["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["compile", "executor thread"]);
        let x: Vec<&Value> = ev.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(x.len(), 3);
        assert_eq!((x[1]["name"].as_str(), x[1]["ts"].as_f64(), x[1]["dur"].as_f64()), (Some("gemm_bias"), Some(10_000.0), Some(2000.0)));
        assert_eq!(x[1]["args"]["ops"], json!(["matmul", "add bias"]));
        assert_eq!(
            (x[2]["name"].as_str(), x[2]["dur"].as_f64(), x[2]["args"]["in_step_us"].as_f64()),
            (Some("add\"q"), Some(1.5), Some(3000.0))
        );
        assert_eq!(x[2]["tid"], 2);
        // A track per CPU thread that worked: a slice per launch it took part in.
        let threads = thread_tracks(p.trace().unwrap(), Duration::from_millis(10));
        let seen: Vec<(&str, Vec<(&str, Duration, Duration)>)> =
            threads.iter().map(|t| (t.name.as_str(), t.slices.iter().map(|s| (s.name.as_str(), s.start, s.dur)).collect())).collect();
        let ms = Duration::from_millis;
        assert_eq!(seen, [("CPU worker 0", vec![("gemm_bias", ms(10), ms(2))]), ("CPU worker 1", vec![("gemm_bias", ms(11), ms(1))])]);
    }
}
