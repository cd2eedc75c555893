//! Data-parallel runs: `--ranks N` starts N copies of this command on this host, each with
//! torchrun's variables (so a process that finds them, from this launcher or from `torchrun`
//! itself, is one rank), and stops them all when one fails. Rank 0 prints, saves and logs;
//! the other ranks train quietly and report only their errors, prefixed with their rank.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fusec_ir::DType;
use fusec_passes::zero::{self, Shard};
use fusec_runtime::dist::launch_env::{local_spawn_plan, LaunchEnv};
use fusec_runtime::executor::Executor;
use fusec_runtime::programs::RunPrograms;

use super::args::{RunArgs, Target};
use crate::CliResult;

/// Starts `n` ranks of this very command line and waits for all of them; the first that fails
/// stops the others, and the error names it.
pub fn launch(n: usize, target: Target) -> CliResult {
    let plan = local_spawn_plan(n)?;
    let exe = std::env::current_exe().map_err(|e| format!("--ranks: cannot find this program to start its ranks: {e}"))?;
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let gpus = visible_gpus();
    let mut children: Vec<Option<Child>> = vec![];
    for env in &plan {
        let mut cmd = Command::new(&exe);
        cmd.args(&args).envs(env.to_vars());
        if target == Target::Cuda {
            cmd.env("CUDA_VISIBLE_DEVICES", gpu_of(&gpus, env.local_rank));
        }
        if env.rank > 0 {
            cmd.stdout(Stdio::null()).stderr(Stdio::piped());
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop(&mut children);
                return Err(format!("--ranks: cannot start rank {}: {e}", env.rank));
            }
        };
        if let Some(err) = child.stderr.take() {
            let rank = env.rank;
            std::thread::spawn(move || BufReader::new(err).lines().map_while(Result::ok).for_each(|l| errln!("[rank {rank}] {l}")));
        }
        children.push(Some(child));
    }
    loop {
        let mut running = 0;
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            match child.try_wait() {
                Ok(None) => running += 1,
                Ok(Some(status)) if status.success() => *slot = None,
                Ok(Some(status)) => {
                    *slot = None;
                    stop(&mut children);
                    let how = status.code().map_or_else(|| "was killed by a signal".to_string(), |c| format!("exited with code {c}"));
                    return Err(format!("rank {rank} of {n} {how}; the other ranks were stopped"));
                }
                Err(e) => {
                    stop(&mut children);
                    return Err(format!("--ranks: cannot watch rank {rank}: {e}"));
                }
            }
        }
        if running == 0 {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills and reaps every rank still running.
fn stop(children: &mut [Option<Child>]) {
    for c in children.iter_mut().flatten() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// The GPUs this process may use: `CUDA_VISIBLE_DEVICES`'s entries, or none said.
fn visible_gpus() -> Option<Vec<String>> {
    std::env::var("CUDA_VISIBLE_DEVICES").ok().map(|v| v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect())
}

/// The GPU of local rank `i`: the i-th visible one (ranks past the list get none and fail with
/// the driver's "no GPU" error), or GPU `i` when nothing restricts them.
fn gpu_of(gpus: &Option<Vec<String>>, i: usize) -> String {
    match gpus {
        Some(list) => list.get(i).cloned().unwrap_or_default(),
        None => i.to_string(),
    }
}

/// Makes this process rank `env.rank`: on CUDA it keeps only its GPU visible (the launcher
/// did so already; under `torchrun` the LOCAL_RANK-th of those visible); other ranks than 0
/// write no files and print nothing but their error. Refuses `--ranks` other than WORLD_SIZE
/// and the reference target. Call before any CUDA call or thread.
pub fn become_rank(a: &mut RunArgs, env: &LaunchEnv) -> CliResult {
    if let Some(n) = a.ranks.filter(|&n| n != env.world_size) {
        return Err(format!("--ranks {n} but WORLD_SIZE={} (launched by torchrun, leave out --ranks or give the same number)", env.world_size));
    }
    if a.target == Target::Ref {
        return Err("data-parallel runs need --target cpu or --target cuda (the reference interpreter is one process)".into());
    }
    if a.target == Target::Cuda {
        let gpus = visible_gpus();
        if gpus.as_ref().is_none_or(|g| g.len() != 1) {
            // At the start of `run`, before the driver reads it and before any other thread.
            std::env::set_var("CUDA_VISIBLE_DEVICES", gpu_of(&gpus, env.local_rank));
        }
    }
    a.ranks = Some(env.world_size);
    if env.rank > 0 {
        // With ZeRO-1 every rank takes part in rank 0's saves (it holds some of the moments);
        // rank 0 alone writes.
        if a.zero == 0 {
            (a.save, a.save_every) = (None, None);
        }
        (a.log_json, a.trace, a.profile_json, a.sample) = (None, None, None, 0);
        crate::out::set_quiet(true);
    }
    Ok(())
}

/// How long ranks wait for each other.
pub fn timeout(a: &RunArgs) -> Duration {
    Duration::from_secs(a.rank_timeout as u64)
}

/// What rank 0 reports for every rank of a data-parallel run.
pub struct RankTimes {
    /// Every rank's mean step time, ms.
    pub step_ms: Vec<f32>,
    /// The collectives' ms a step, (busy, exposed), mean of the ranks; `Err`: why this
    /// executor could not time them; `None`: it does not time them.
    pub comm: Option<Result<(f32, f32), String>>,
}

/// Every rank's mean step time (`ms`, this rank's) and its collectives' times, gathered through
/// the executor's collective as a mean of vectors that are zero but for each rank's own slot
/// (the collectives' times: the mean of every rank's): a collective every rank calls at the
/// same point.
pub fn rank_times(ex: &mut dyn Executor, env: &LaunchEnv, ms: f64) -> Result<RankTimes, String> {
    let n = env.world_size;
    let mut v = vec![0f32; n + 2];
    v[env.rank] = ms as f32 * n as f32;
    let comm = ex.comm_times().map(|r| r.and_then(|t| match t.steps {
        0 => Err("no step was timed (the first is left out)".to_string()),
        s => Ok(((t.busy_ms / s as f64) as f32, (t.exposed_ms / s as f64) as f32)),
    }));
    if let Some(Ok((busy, exposed))) = comm {
        (v[n], v[n + 1]) = (busy, exposed);
    }
    ex.all_reduce_host(&mut v)?;
    let comm = comm.map(|c| c.map(|_| (v[n], v[n + 1])));
    v.truncate(n);
    Ok(RankTimes { step_ms: v, comm })
}

/// ZeRO-1's AdamW moments as a checkpoint holds them: `m.P` and `v.P` of every parameter (f32,
/// its shape), in parameter order, each with the rank that holds it.
pub fn zero_moments(run: &RunPrograms, shard: Shard) -> Result<Vec<((String, DType, Vec<usize>), usize)>, String> {
    let step = run.step()?;
    let owners = zero::param_owners(step, shard.world)?;
    let mut out = vec![];
    for ((name, v), owner) in step.params().iter().zip(owners) {
        let shape: Vec<usize> = step.ty(*v).shape.eval(&run.bind)?.into_iter().collect();
        for prefix in ["m.", "v."] {
            out.push(((format!("{prefix}{name}"), DType::F32, shape.clone()), owner));
        }
    }
    Ok(out)
}

/// Rank `owner`'s state tensor `name` (`len` values) into `out` on every rank (a collective:
/// every rank calls it for the same tensors in the same order).
pub fn gather_moment(ex: &mut dyn Executor, shard: Shard, name: &str, (owner, len): (usize, usize), out: &mut Vec<f32>) -> Result<(), String> {
    if owner == shard.rank {
        ex.get_f32(name, out)?;
    } else {
        out.clear();
        out.resize(len, 0.0);
    }
    if out.len() != len {
        return Err(format!("`{name}` holds {} values, the checkpoint {len}", out.len()));
    }
    ex.from_owner_host(out, owner)
}

/// A rank other than 0's part in rank 0's ZeRO-1 save: every moment it holds, in the order rank
/// 0 writes them ([`super::resume::save`]).
pub fn serve_moments(ex: &mut dyn Executor, run: &RunPrograms, shard: Shard) -> Result<(), String> {
    let mut v = vec![];
    for ((name, _, shape), owner) in zero_moments(run, shard)? {
        gather_moment(ex, shard, &name, (owner, shape.iter().product()), &mut v)?;
    }
    Ok(())
}

/// Stops the process when training makes no progress for `timeout`: NCCL's collectives wait
/// forever for a rank that hangs, so every rank watches its own steps and, past the timeout,
/// exits with an error (the launcher, or torchrun's agent, then stops the others). Ticked
/// after every step; dropped when training ends.
pub struct Watchdog {
    last: Arc<Mutex<Instant>>,
    done: Arc<AtomicBool>,
}

impl Watchdog {
    /// Starts watching rank `rank`: the first step must end within `timeout` from now.
    pub fn start(rank: usize, timeout: Duration) -> Watchdog {
        let last = Arc::new(Mutex::new(Instant::now()));
        let done = Arc::new(AtomicBool::new(false));
        let (l, d) = (last.clone(), done.clone());
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(200).min(timeout));
            if d.load(Ordering::Relaxed) {
                return;
            }
            let idle = l.lock().map(|t| t.elapsed()).unwrap_or_default();
            if idle >= timeout {
                crate::out::set_quiet(false);
                errln!(
                    "error: rank {rank}: no training step finished for {:.0} s (--rank-timeout): this rank or another hangs; stopping",
                    idle.as_secs_f64()
                );
                std::process::exit(2);
            }
        });
        Watchdog { last, done }
    }

    /// A step ended.
    pub fn tick(&self) {
        if let Ok(mut t) = self.last.lock() {
            *t = Instant::now();
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
    }
}

/// A test hook: `FUSEC_TEST_STALL=RANK:STEP` makes rank `RANK` stop making progress after step
/// `STEP` (it sleeps), as a hung rank would.
pub fn stall_if_asked(rank: usize, step: usize) {
    if std::env::var("FUSEC_TEST_STALL").is_ok_and(|v| v == format!("{rank}:{step}")) {
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}
