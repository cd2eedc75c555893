//! What `fusec run` prints: the progress bar, the summary table and the per-kernel profile.

use std::io::IsTerminal;
use std::time::Instant;

use fusec_runtime::profile::{Profile, Stat};
use fusec_runtime::roofline::{percent_of_roof, Limits};
use fusec_runtime::train::StepLog;

/// A one-line progress bar on a terminal; a line every few steps otherwise (logs stay short).
/// Both show the time left (from the steps this process ran so far) and, when the learning
/// rate follows a schedule, the step's learning rate.
pub struct Progress {
    total: usize,
    first: usize,
    tokens_per_step: f64,
    tty: bool,
    every: usize,
    show_lr: bool,
    start: Instant,
}

impl Progress {
    /// A bar for the steps `first..total` (a resumed run starts past 0) of `tokens_per_step`
    /// tokens; `show_lr` adds the learning rate.
    pub fn new(first: usize, total: usize, tokens_per_step: usize, show_lr: bool) -> Progress {
        let tty = std::io::stderr().is_terminal();
        let every = (total.saturating_sub(first) / 20).max(1);
        Progress { total, first, tokens_per_step: tokens_per_step as f64, tty, every, show_lr, start: Instant::now() }
    }

    /// Shows one finished step.
    pub fn step(&mut self, r: &StepLog) {
        let done = r.step + 1;
        let tok_s = self.tokens_per_step / r.ms * 1e3;
        let val = r.val_loss.map(|v| format!(" val {v:.4}")).unwrap_or_default();
        let lr = if self.show_lr { format!(" lr {:.3e}", r.lr) } else { String::new() };
        let eta = eta(self.start.elapsed().as_secs_f64(), done - self.first, self.total - done);
        if self.tty {
            let width = 24;
            let filled = width * done / self.total.max(1);
            let bar: String = "#".repeat(filled) + &".".repeat(width - filled);
            err!("\r[{bar}] step {done}/{} loss {:.4}{val}{lr} | {:.1} ms | {:.0} tok/s | ETA {eta}   ", self.total, r.loss, r.ms, tok_s);
            if done == self.total {
                errln!();
            }
        } else if (r.step - self.first).is_multiple_of(self.every) || done == self.total || r.val_loss.is_some() {
            errln!("step {done:>5}/{}: loss {:.6}{val}{lr}  {:.1} ms  {tok_s:.0} tok/s  ETA {eta}", self.total, r.loss, r.ms);
        }
    }
}

/// The time left for `left` steps at the mean pace of the `done` steps that took `secs`, as
/// `1h02m`, `3m05s` or `12s`.
fn eta(secs: f64, done: usize, left: usize) -> String {
    let s = (secs / done.max(1) as f64 * left as f64).round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s / 60 % 60),
    }
}

/// Rows of the summary table: (label, value).
pub fn table(title: &str, rows: &[(String, String)]) -> String {
    let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut s = format!("── {title} {}\n", "─".repeat(60usize.saturating_sub(title.len() + 4)));
    for (k, v) in rows {
        s += &format!("{k:<w$}  {v}\n");
    }
    s
}

/// Mebibytes.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1048576.0)
}

/// The per-kernel table: name, calls, total, avg, min, max, % of all launches, GB/s, GFLOP/s,
/// and with device limits `% roof` (the percentage of the roof at the kernel's intensity:
/// [`percent_of_roof`]; `-` without limits or counts).
pub fn profile_table(p: &Profile, steps: usize, limits: Option<&Limits>) -> String {
    let total = p.total().as_secs_f64().max(1e-12);
    let mut rows: Vec<_> = p.rows();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1.total));
    let mut s = format!(
        "{:<32} {:>7} {:>10} {:>9} {:>9} {:>9} {:>6} {:>9} {:>8} {:>9} {:>7}\n",
        "kernel", "calls", "total ms", "avg ms", "min ms", "max ms", "%", "MB/call", "GB/s", "GFLOP/s", "% roof"
    );
    for (name, st) in rows {
        let t = st.total.as_secs_f64();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let roof = match roof_pct(st, limits) {
            Some(r) => format!("{r:>7.1}"),
            None => format!("{:>7}", "-"),
        };
        s += &format!(
            "{:<32} {:>7} {:>10.2} {:>9.3} {:>9.3} {:>9.3} {:>6.1} {:>9.2} {:>8.1} {:>9.1} {roof}\n",
            truncate(name, 32),
            st.calls,
            t * 1e3,
            t * 1e3 / st.calls.max(1) as f64,
            ms(st.min),
            ms(st.max),
            100.0 * t / total,
            st.bytes as f64 / st.calls.max(1) as f64 / 1e6,
            st.bytes as f64 / t.max(1e-12) / 1e9,
            st.flops as f64 / t.max(1e-12) / 1e9,
        );
    }
    s += &format!(
        "{} launches timed over {steps} step(s) (the first, warm-up, and validation not timed): {:.1} ms per step\n",
        p.rows().iter().map(|r| r.1.calls).sum::<u64>(),
        total * 1e3 / steps.max(1) as f64
    );
    s
}

/// A kernel's `% roof` over its timed launches.
fn roof_pct(st: &Stat, limits: Option<&Limits>) -> Option<f64> {
    percent_of_roof(st.flops, st.bytes, st.total.as_secs_f64(), limits?).filter(|r| r.is_finite())
}

/// The profile as JSON: one object per kernel name (`roof_pct` as in the table, or null).
pub fn profile_json(p: &Profile, limits: Option<&Limits>) -> String {
    let rows: Vec<String> = p
        .rows()
        .iter()
        .map(|(name, st)| {
            let roof = roof_pct(st, limits).map_or("null".to_string(), |r| r.to_string());
            format!(
                "{{\"kernel\":\"{}\",\"calls\":{},\"total_ms\":{},\"min_ms\":{},\"max_ms\":{},\"bytes\":{},\"flops\":{},\"roof_pct\":{roof}}}",
                name.replace('"', "\\\""),
                st.calls,
                st.total.as_secs_f64() * 1e3,
                st.min.as_secs_f64() * 1e3,
                st.max.as_secs_f64() * 1e3,
                st.bytes,
                st.flops
            )
        })
        .collect();
    format!("[\n  {}\n]\n", rows.join(",\n  "))
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n - 1).collect::<String>() + "…"
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn eta_is_the_mean_pace_times_the_steps_left() {
        assert_eq!(super::eta(10.0, 10, 5), "5s");
        assert_eq!(super::eta(1.0, 1, 185), "3m05s");
        assert_eq!(super::eta(2.0, 1, 1861), "1h02m");
        assert_eq!(super::eta(3.0, 2, 0), "0s");
    }
}
