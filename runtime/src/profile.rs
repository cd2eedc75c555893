//! Per-launch timing aggregated by kernel name: the `--profile` table and JSON.

use std::collections::{HashMap, HashSet};

use crate::programs::Program;
use std::time::Duration;

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

/// Timings of every kernel name, in first-launch order, over the training programs' runs after
/// their first (the warm-up: lazy loading, library heuristics); validation is not timed.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    order: Vec<String>,
    stats: HashMap<String, Stat>,
    warm: HashSet<Program>,
    /// Timed runs of the Step program: the table's "per step".
    pub steps: u64,
}

impl Profile {
    /// Whether this run of `program` is timed (see the type's docs); counts timed steps.
    pub fn begin(&mut self, program: Program) -> bool {
        if !matches!(program, Program::Step | Program::Grad) || self.warm.insert(program) {
            return false;
        }
        self.steps += (program == Program::Step) as u64;
        true
    }

    /// Adds one launch's time by name, with its static byte and FLOP counts (any target).
    pub fn record(&mut self, name: &str, bytes: u64, flops: u64, dt: Duration) {
        if !self.stats.contains_key(name) {
            self.order.push(name.to_string());
            self.stats.insert(name.to_string(), Stat { min: dt, ..Stat::default() });
        }
        let s = self.stats.get_mut(name).expect("inserted above");
        s.calls += 1;
        s.total += dt;
        s.min = s.min.min(dt);
        s.max = s.max.max(dt);
        s.bytes += bytes;
        s.flops += flops;
    }

    /// The stats in first-launch order.
    pub fn rows(&self) -> Vec<(&str, &Stat)> {
        self.order.iter().map(|n| (n.as_str(), &self.stats[n])).collect()
    }

    /// Total time of every launch.
    pub fn total(&self) -> Duration {
        self.stats.values().map(|s| s.total).sum()
    }
}
