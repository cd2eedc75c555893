//! The summary table at the end of `fusec run`: losses, speed, where the wall time went (phases
//! that add up to it), memory.

use std::time::Duration;

use fusec_passes::pipeline::PassRun;
use fusec_runtime::executor::Executor;
use fusec_runtime::programs::Program;
use fusec_runtime::train::{StepLog, TrainOutcome};

use super::args::RunArgs;
use crate::report::mib;

/// Seconds spent in each phase of a run; what is not in one is `other`.
#[derive(Clone, Debug, Default)]
pub struct Phases {
    /// Reading the graph and data, checks, initializing or loading parameters and state.
    pub init: f64,
    /// Passes, memory plan, code generation, the executor's allocation.
    pub compile: f64,
    /// Training steps (without validation and saving).
    pub train: f64,
    /// Validation losses.
    pub validation: f64,
    /// Writing checkpoints.
    pub saving: f64,
    /// `--sample`.
    pub sample: f64,
}

impl Phases {
    /// `init 0.2 s · compile 1.0 s · … · other 0.0 s = 4.8 s`: the phases and what is left of
    /// `wall` seconds.
    pub fn row(&self, wall: f64) -> String {
        let named = [
            ("init", self.init),
            ("compile", self.compile),
            ("train", self.train),
            ("validation", self.validation),
            ("saving", self.saving),
            ("sample", self.sample),
        ];
        let other = (wall - named.iter().map(|(_, s)| s).sum::<f64>()).max(0.0);
        let parts: Vec<String> = named.iter().chain(&[("other", other)]).map(|(n, s)| format!("{n} {s:.2} s")).collect();
        format!("{} = {wall:.2} s", parts.join(" · "))
    }
}

/// What the summary reports about a finished training run.
pub struct Summary<'a> {
    /// The flags.
    pub args: &'a RunArgs,
    /// CPU threads.
    pub threads: usize,
    /// The training run.
    pub outcome: &'a TrainOutcome,
    /// Steps done before this process (a resumed run).
    pub start: usize,
    /// Tokens per optimizer step.
    pub tokens_per_step: usize,
    /// Every program's per-pass times (the row shows the Step program's).
    pub pass_runs: &'a [(Program, PassRun)],
    /// From the process start to the end of the first step.
    pub first_done: Duration,
    /// Where the time went.
    pub phases: &'a Phases,
    /// Parameter bytes (f32).
    pub param_bytes: u64,
    /// Every rank's mean step time and collectives' times in a data-parallel run.
    pub rank_times: Option<super::ranks::RankTimes>,
}

/// The mean step time of the steps after the first (`None` with one step or none).
pub fn steady_ms(logs: &[StepLog]) -> Option<f64> {
    (logs.len() > 1).then(|| logs[1..].iter().map(|l| l.ms).sum::<f64>() / (logs.len() - 1) as f64)
}

impl Summary<'_> {
    /// `rank 0 33.4 · rank 1 33.6 ms/step, the slowest 0.6% above the fastest` in a
    /// data-parallel run.
    fn rank_row(&self) -> Option<String> {
        let ms = self.rank_times.as_ref().map(|t| &t.step_ms).filter(|m| !m.is_empty())?;
        let each: Vec<String> = ms.iter().enumerate().map(|(r, m)| format!("rank {r} {m:.1}")).collect();
        let (lo, hi) = ms.iter().fold((f32::INFINITY, 0f32), |(lo, hi), &m| (lo.min(m), hi.max(m)));
        Some(format!("{} ms/step, the slowest {:.1}% above the fastest", each.join(" · "), (hi / lo - 1.0) * 100.0))
    }

    /// The rows: (label, value); `build` (the executor's rows) go after the timing rows.
    pub fn rows(&self, ex: &dyn Executor, build: &[(String, String)], wall: f64) -> Vec<(String, String)> {
        let (a, logs) = (self.args, &self.outcome.logs);
        let compile_ms = self.phases.compile * 1e3;
        let per_rank = match a.ranks.filter(|&n| n > 1) {
            Some(n) => format!(" per rank x {n} ranks"),
            None => String::new(),
        };
        let target = ("target".to_string(), format!("{}, {} thread(s), B={}{per_rank} T={}", a.target_name(), self.threads, a.batch, a.seq));
        let compile = ("compile".to_string(), format!("{compile_ms:.1} ms: {}", pass_times(self.pass_runs)));
        let mut rows = match (logs.first(), logs.last()) {
            (Some(first), Some(last)) => self.step_rows(first, last, compile, compile_ms),
            // Resumed at the last step (a run killed after its final save): nothing to train.
            _ => vec![("loss".into(), format!("no step left: resumed at step {} of {}", self.start, a.steps)), compile],
        };
        rows.insert(0, target);
        self.extra_rows(&mut rows, ex, build, wall);
        rows
    }

    /// The rows about the steps trained (from the first and last step's logs), with `compile`.
    fn step_rows(&self, first_log: &StepLog, last_log: &StepLog, compile: (String, String), compile_ms: f64) -> Vec<(String, String)> {
        let (a, logs) = (self.args, &self.outcome.logs);
        let (first, last) = (first_log.loss, last_log.loss);
        let ms = steady_ms(logs).unwrap_or(first_log.ms);
        let val = match self.outcome.final_val {
            Some(v) => format!(" (val {v:.4} after step {})", a.steps),
            None => logs.iter().rev().find_map(|l| l.val_loss).map(|v| format!(" (last val {v:.4})")).unwrap_or_default(),
        };
        let resumed = match &a.resume {
            Some(dir) => format!(", steps {}..={} resumed from {}", self.start + 1, a.steps, dir.display()),
            None => String::new(),
        };
        let mut rows = vec![
            ("loss".into(), format!("{first:.4} → {last:.4} over {} steps{val}{resumed}", logs.len())),
            ("step time".into(), format!("{ms:.1} ms/step (first step {:.1} ms)", first_log.ms)),
            ("throughput".into(), format!("{:.0} tok/s", self.tokens_per_step as f64 / ms * 1e3)),
            compile,
            (
                "first step".into(),
                format!(
                    "compile + first step {:.2} s; started {:.2} s and done {:.2} s after start",
                    (compile_ms + first_log.ms) / 1e3,
                    self.first_done.as_secs_f64() - first_log.ms / 1e3,
                    self.first_done.as_secs_f64()
                ),
            ),
        ];
        if let Some(row) = self.rank_row() {
            rows.insert(3, ("per rank".into(), row));
        }
        if let Some(comm) = self.rank_times.as_ref().and_then(|t| t.comm.as_ref()) {
            rows.insert(4, ("comm".into(), comm_row(comm, ms)));
        }
        rows
    }

    /// The executor's rows, then memory and phases.
    fn extra_rows(&self, rows: &mut Vec<(String, String)>, ex: &dyn Executor, build: &[(String, String)], wall: f64) {
        rows.extend_from_slice(build);
        if let (Some(alloc), Some(peak)) = (ex.allocated_device_bytes(), ex.peak_device_bytes()) {
            let what = format!(
                "{} allocated by fusec (plan, scratch, cuBLAS workspace); {} in use on the device (CUDA context included)",
                mib(alloc),
                mib(peak)
            );
            rows.push(("peak memory".into(), what));
        }
        if let Some(peak) = fusec_runtime::host::peak_rss_bytes() {
            let ratio = peak as f64 / self.param_bytes.max(1) as f64;
            let mut what = format!("peak {} resident = {ratio:.2}x the {} of f32 parameters", mib(peak), mib(self.param_bytes));
            if let Some((anon, file)) = fusec_runtime::host::rss_split_bytes() {
                what += &format!("; now {} of the process's own + {} of mapped files (libraries)", mib(anon), mib(file));
            }
            rows.push(("host memory".into(), what));
        }
        rows.push(("phases".into(), self.phases.row(wall)));
    }
}

/// `collectives 1.62 ms a step: 1.10 hidden beside the backward, 0.52 exposed (1.5% of the
/// step)`, from the ranks' mean (busy, exposed) ms a step and the step's `ms`.
fn comm_row(comm: &Result<(f32, f32), String>, ms: f64) -> String {
    match comm {
        Ok((busy, exposed)) => format!(
            "collectives {busy:.2} ms a step: {:.2} hidden beside the backward, {exposed:.2} exposed ({:.1}% of the step; mean of the ranks)",
            (busy - exposed).max(0.0),
            100.0 * *exposed as f64 / ms.max(1e-9)
        ),
        Err(e) => format!("not timed: {e}"),
    }
}

/// The Step program's passes and their times in ms.
fn pass_times(runs: &[(Program, PassRun)]) -> String {
    let step = runs.iter().filter(|(p, _)| *p == Program::Step);
    step.map(|(_, r)| format!("{} {:.1}", r.name, r.time.as_secs_f64() * 1e3)).collect::<Vec<_>>().join(" · ")
}

#[cfg(test)]
mod tests {
    #[test]
    fn phases_add_up_to_the_wall_time() {
        let p = super::Phases { init: 0.5, compile: 1.0, train: 2.0, validation: 0.25, saving: 0.125, sample: 0.0 };
        assert_eq!(
            p.row(4.0),
            "init 0.50 s · compile 1.00 s · train 2.00 s · validation 0.25 s · saving 0.12 s · sample 0.00 s · other 0.12 s = 4.00 s"
        );
    }
}
