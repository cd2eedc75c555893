//! `fusec run --trace FILE.json`: the timeline of a run's compile passes and build phases
//! (one track) and of the first step after the warm-up (a track of its launches: the CUDA
//! stream, or the CPU executor thread; in a data-parallel run a track of its collectives; on
//! the CPU a track per worker thread), in the Chrome trace-event format
//! ([`fusec_runtime::trace`]). Time 0 is the start of compiling.

use std::path::Path;
use std::time::{Duration, Instant};

use fusec_passes::pipeline::PassRun;
use fusec_runtime::profile::{Profile, TracedLaunch};
use fusec_runtime::programs::Program;
use fusec_runtime::trace::{launch_track, object, thread_tracks, Slice, Timeline, Track};
use serde_json::json;

use super::args::{RunArgs, Target};

/// When the compile work ran: the zero of the timeline, each program's passes, and the
/// executor's build phases (one after the other from `build_start`).
pub struct CompileTimes<'a> {
    /// The start of compiling: the timeline's zero.
    pub zero: Instant,
    /// Every program's passes, in the order they ran.
    pub passes: &'a [(Program, PassRun)],
    /// When the executor's build began.
    pub build_start: Instant,
    /// The build's phases, in order.
    pub build: &'a [(String, Duration)],
}

/// The compile track: a slice per pass (its program in the arguments), then a slice per build
/// phase.
fn compile_track(c: &CompileTimes, target: &str) -> Track {
    let since = |t: Instant| t.saturating_duration_since(c.zero);
    let mut slices: Vec<Slice> = c
        .passes
        .iter()
        .map(|(p, r)| Slice {
            name: r.name.to_string(),
            cat: "compile",
            start: since(r.start),
            dur: r.time,
            args: object(json!({"program": format!("{p:?}"), "pass": r.name})),
        })
        .collect();
    let mut at = since(c.build_start);
    for (name, d) in c.build {
        let args = object(json!({ "build": format!("{target} executor") }));
        slices.push(Slice { name: name.clone(), cat: "compile", start: at, dur: *d, args });
        at += *d;
    }
    Track { name: "compile".into(), slices }
}

/// Writes the timeline of the traced step in `profile` and the compile work before it to
/// `path`; returns the step's launches. An error when no whole step was recorded.
pub fn write(
    path: &Path,
    a: &RunArgs,
    threads: usize,
    step: usize,
    compile: &CompileTimes,
    profile: Option<&Profile>,
) -> Result<usize, String> {
    let Some(trace) = profile.and_then(|p| p.trace()).filter(|t| t.complete()) else {
        return Err(format!("--trace {}: no step was recorded (the run took fewer than 2 steps)", path.display()));
    };
    let started = trace.started.unwrap_or(compile.zero);
    let target = a.target_name();
    let at = started.saturating_duration_since(compile.zero);
    // A data-parallel run shows its collectives on a track of their own.
    let ranks = a.ranks.unwrap_or(1);
    let collective = |l: &TracedLaunch| ranks > 1 && l.ops.iter().any(|op| matches!(*op, "all_reduce" | "from_owners"));
    let launches = match a.target {
        Target::Cuda => "CUDA stream (every launch, in order)".to_string(),
        _ => format!("executor thread (each launch, on up to {threads} threads)"),
    };
    let mut tracks = vec![compile_track(compile, target), launch_track(launches, trace, at, |l| !collective(l))];
    if ranks > 1 {
        let how = if a.target == Target::Cuda { "NCCL" } else { "TCP through rank 0" };
        tracks.push(launch_track(format!("collectives ({how}, {ranks} ranks)"), trace, at, collective));
    }
    tracks.extend(thread_tracks(trace, at));
    let timeline = Timeline {
        process: format!("fusec run {} --target {target}: compile, then step {step}", a.file.display()),
        tracks,
        about: object(json!({
            "graph": a.file.display().to_string(),
            "target": target,
            "precision": a.precision.name(),
            "batch": a.batch,
            "seq": a.seq,
            "grad_accum": a.grad_accum,
            "threads": threads,
            "step": step,
            "launches": trace.launches.len(),
            "times": match a.target {
                Target::Cuda => "CUDA events within each program run; runs placed by the host clock",
                _ => "host clock",
            },
        })),
    };
    timeline.write(path).map_err(|e| format!("--trace: {e}"))?;
    Ok(trace.launches.len())
}
