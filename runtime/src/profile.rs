//! Per-launch timing aggregated by kernel name (the `--profile` table and JSON), and the
//! launches of one step as they ran (the `--trace` timeline, [`StepTrace`]).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::programs::Program;

/// Timing of one kernel name over a run.
#[derive(Clone, Debug, Default)]
pub struct Stat {
    /// Launches.
    pub calls: u64,
    /// Total time.
    pub total: Duration,
    /// Fastest launch.
    pub min: Duration,
    /// Slowest launch.
    pub max: Duration,
    /// Static bytes moved over all launches.
    pub bytes: u64,
    /// Static FLOPs over all launches.
    pub flops: u64,
}

/// One timed launch, as an executor reports it to [`Profile::record`].
#[derive(Clone, Copy, Debug)]
pub struct Timed<'a> {
    /// The launch's name (the profile's row).
    pub name: &'a str,
    /// Static bytes moved.
    pub bytes: u64,
    /// Static FLOPs.
    pub flops: u64,
    /// The IR ops it runs.
    pub ops: &'a [&'static str],
    /// When it started, from the start of its program run's first launch.
    pub start: Duration,
    /// How long it ran.
    pub dur: Duration,
    /// Where each busy CPU thread spent it: (thread slot, start after the launch's, duration);
    /// empty on the GPU.
    pub threads: &'a [(usize, Duration, Duration)],
}

/// Timings of every kernel name, in first-launch order, over the training programs' runs after
/// their first (the warm-up: lazy loading, library heuristics); validation is not timed. With a
/// [`StepTrace`] ([`Profile::tracing`]) it also keeps the launches of one step in order, and may
/// time that step alone.
#[derive(Clone, Debug)]
pub struct Profile {
    order: Vec<String>,
    stats: HashMap<String, Stat>,
    warm: HashSet<Program>,
    /// Time every run after the warm-up (`--profile`); otherwise only the traced step's.
    every: bool,
    trace: Option<StepTrace>,
    /// Timed runs of the Step program: the table's "per step".
    pub steps: u64,
}

impl Default for Profile {
    /// Times every training run after the warm-up; no trace.
    fn default() -> Profile {
        Profile { order: vec![], stats: HashMap::new(), warm: HashSet::new(), every: true, trace: None, steps: 0 }
    }
}

impl Profile {
    /// A profile that records the first step after the warm-up as a [`StepTrace`]; `every`
    /// times every later step too (`--profile`), otherwise that step alone is timed.
    pub fn tracing(every: bool) -> Profile {
        Profile { every, trace: Some(StepTrace::default()), ..Profile::default() }
    }

    /// Whether every training run after the warm-up is timed (not only a traced step's).
    pub fn times_every_step(&self) -> bool {
        self.every
    }

    /// Whether this run of `program` is timed (see the type's docs); counts timed steps. Call
    /// it right before the run's launches: a traced run is placed at this moment.
    pub fn begin(&mut self, program: Program) -> bool {
        let trains = matches!(program, Program::Step | Program::Grad);
        let warm_up = trains && self.warm.insert(program);
        let traced = self.trace.as_mut().is_some_and(|t| t.begin(program, trains, warm_up));
        let timed = trains && !warm_up && (self.every || traced);
        self.steps += (timed && program == Program::Step) as u64;
        timed
    }

    /// Whether the launches of the run under way are kept in the trace.
    pub fn tracing_now(&self) -> bool {
        self.trace.as_ref().is_some_and(|t| t.current.is_some())
    }

    /// Adds one timed launch of the current run (any target).
    pub fn record(&mut self, t: Timed) {
        if !self.stats.contains_key(t.name) {
            self.order.push(t.name.to_string());
            self.stats.insert(t.name.to_string(), Stat { min: t.dur, ..Stat::default() });
        }
        let s = self.stats.get_mut(t.name).expect("inserted above");
        s.calls += 1;
        s.total += t.dur;
        s.min = s.min.min(t.dur);
        s.max = s.max.max(t.dur);
        s.bytes += t.bytes;
        s.flops += t.flops;
        if let Some(trace) = self.trace.as_mut() {
            trace.record(&t);
        }
    }

    /// The stats in first-launch order.
    pub fn rows(&self) -> Vec<(&str, &Stat)> {
        self.order.iter().map(|n| (n.as_str(), &self.stats[n])).collect()
    }

    /// Total time of every launch.
    pub fn total(&self) -> Duration {
        self.stats.values().map(|s| s.total).sum()
    }

    /// The traced step, when tracing.
    pub fn trace(&self) -> Option<&StepTrace> {
        self.trace.as_ref()
    }
}

/// One launch of the traced step.
#[derive(Clone, Debug)]
pub struct TracedLaunch {
    /// The launch's name, as in the profile.
    pub name: String,
    /// The program run it belongs to (Grad micro-steps, then Step).
    pub program: Program,
    /// Static bytes moved.
    pub bytes: u64,
    /// Static FLOPs.
    pub flops: u64,
    /// The IR ops it runs.
    pub ops: Vec<&'static str>,
    /// When it started, from the start of the step (the first launch starts at zero).
    pub start: Duration,
    /// How long it ran.
    pub dur: Duration,
    /// Where each busy CPU thread spent it: (thread slot, start within the step, duration).
    pub threads: Vec<(usize, Duration, Duration)>,
}

/// The launches of one optimizer step, in order, with their start and duration: the first step
/// after the warm-up (the runs after the first Step run, up to and including the next Step
/// run: with `--grad-accum k`, its k-1 Grad runs and its Step run). Each run is placed at the
/// host time its launches began; within a run, launches are placed by the target's clock
/// (host clocks on the CPU, CUDA events on the GPU).
#[derive(Clone, Debug, Default)]
pub struct StepTrace {
    /// The step's launches in the order they ran.
    pub launches: Vec<TracedLaunch>,
    /// When the step's first run began (host clock).
    pub started: Option<Instant>,
    armed: bool,
    done: bool,
    /// The run being recorded: its program and its start from the step's start.
    current: Option<(Program, Duration)>,
}

impl StepTrace {
    /// Whether the run of `program` that starts now is recorded; `trains`: a Grad or Step run,
    /// `warm_up`: its program's first run.
    fn begin(&mut self, program: Program, trains: bool, warm_up: bool) -> bool {
        self.current = None;
        if self.done || !trains {
            return false;
        }
        if warm_up {
            // The warm-up step ends with the first Step run; the traced step follows it.
            self.armed |= program == Program::Step;
            return false;
        }
        if !self.armed {
            return false;
        }
        let now = Instant::now();
        let at = now - *self.started.get_or_insert(now);
        self.current = Some((program, at));
        self.done = program == Program::Step;
        true
    }

    fn record(&mut self, t: &Timed) {
        if let Some((program, at)) = self.current {
            self.launches.push(TracedLaunch {
                name: t.name.to_string(),
                program,
                bytes: t.bytes,
                flops: t.flops,
                ops: t.ops.to_vec(),
                start: at + t.start,
                dur: t.dur,
                threads: t.threads.iter().map(|&(k, s, d)| (k, at + t.start + s, d)).collect(),
            });
        }
    }

    /// Whether a whole step was recorded.
    pub fn complete(&self) -> bool {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(p: &mut Profile, program: Program, names: &[&str]) -> bool {
        let timed = p.begin(program);
        if timed {
            let ms = Duration::from_millis;
            for (i, name) in names.iter().enumerate() {
                p.record(Timed { name, bytes: 8, flops: 2, ops: &["add"], start: ms(2 * i as u64), dur: ms(1), threads: &[] });
            }
            // The run takes the time its launches say.
            std::thread::sleep(ms(2 * names.len() as u64));
        }
        timed
    }

    #[test]
    fn the_trace_holds_the_step_after_the_warm_up_and_times_it_alone() {
        let mut p = Profile::tracing(false);
        // --grad-accum 2: Grad, Step per step; validation runs Eval between steps.
        assert!(!run(&mut p, Program::Grad, &["g"]));
        assert!(!run(&mut p, Program::Step, &["s"]));
        assert!(!run(&mut p, Program::Eval, &["e"]));
        assert!(run(&mut p, Program::Grad, &["g1", "g2"]));
        assert!(run(&mut p, Program::Step, &["s1", "s2", "s3"]));
        assert!(!run(&mut p, Program::Grad, &["g"]));
        assert!(!run(&mut p, Program::Step, &["s"]));
        let t = p.trace().unwrap();
        assert!(t.complete());
        let names: Vec<(&str, Program)> = t.launches.iter().map(|l| (l.name.as_str(), l.program)).collect();
        use Program::{Grad, Step};
        assert_eq!(names, [("g1", Grad), ("g2", Grad), ("s1", Step), ("s2", Step), ("s3", Step)]);
        assert_eq!(t.launches[0].start, Duration::ZERO);
        assert!(t.launches.windows(2).all(|w| w[0].start + w[0].dur <= w[1].start), "{:?}", t.launches);
        assert_eq!((p.steps, p.rows().len()), (1, 5));
    }

    #[test]
    fn profiling_every_step_still_traces_one() {
        let mut p = Profile::tracing(true);
        for _ in 0..4 {
            run(&mut p, Program::Step, &["a", "b"]);
        }
        assert_eq!(p.steps, 3);
        assert_eq!(p.rows()[0].1.calls, 3);
        assert_eq!(p.trace().unwrap().launches.len(), 2);
        let mut plain = Profile::default();
        for _ in 0..4 {
            run(&mut plain, Program::Step, &["a"]);
        }
        assert!(plain.trace().is_none() && plain.steps == 3);
    }
}
