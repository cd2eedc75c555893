//! The random initialization's normals: ns per normal of the exact path (`Rng::normal`, libm's
//! `ln` and `cos`) and the fast one (`fusec_runtime::normals::fill`), on one thread and on all
//! of rayon's, in the same run; and a bit-for-bit comparison of the two over many values.
//!
//! `init_bench [N]`: times N normals (default 2^24) per path, best of 3.
//! `init_bench check [N]`: compares N normals (default 2^30; across seeds and GPT-2's stds) and
//! reports mismatches (must be 0: exit code 1 otherwise) and how many values the fast path
//! recomputed exactly.

use std::time::Instant;

use clap::{Parser, Subcommand};
use fusec_ir::rng::Rng;
use fusec_runtime::normals::{fill, fill_exact, par_fill, FillFn};

/// The command line (see the module docs).
#[derive(Parser)]
#[command(
    about = "The random initialization's normals: ns per normal of the exact and the fast path, or (`check`) the two compared bit for bit",
    args_conflicts_with_subcommands = true,
    disable_help_subcommand = true
)]
struct Args {
    /// `check`: compare the paths instead of timing them
    #[command(subcommand)]
    command: Option<Command>,
    /// Normals to time per path (best of 3) [default: 2^24]
    #[arg(value_name = "N", default_value_t = 1 << 24, hide_default_value = true)]
    n: usize,
}

#[derive(Subcommand)]
enum Command {
    /// Compare N normals of the fast path with the exact path's, bit for bit (exit code 1 on a mismatch)
    Check {
        /// Normals to compare, across seeds and GPT-2's stds [default: 2^30]
        #[arg(value_name = "N", default_value_t = 1 << 30, hide_default_value = true)]
        n: u64,
    },
}

/// GPT-2's stds (0.02, 0.02/√(2·48) for 1.5B) and 1.
const STDS: [f64; 3] = [0.02, 0.002_041_241_452_319_315, 1.0];

/// Best of 3 wall times of `run`, in ns per normal of `n`.
fn best_ns(n: usize, mut run: impl FnMut()) -> f64 {
    (0..3)
        .map(|_| {
            let t = Instant::now();
            run();
            t.elapsed().as_secs_f64() * 1e9 / n as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn bench(n: usize) {
    let mut out = vec![0f32; n];
    let threads = rayon::current_num_threads();
    println!("{n} normals, std 0.02; ns per normal (best of 3)");
    println!("{:<6} {:>10} {:>14}", "path", "1 thread", format!("{threads} threads"));
    let paths: [(&str, FillFn); 2] = [("exact", fill_exact), ("fast", fill)];
    let mut rows = vec![];
    for (name, f) in paths {
        let one = best_ns(n, || {
            f(&mut Rng::new(1), &mut out, 0.02);
        });
        let all = best_ns(n, || {
            par_fill(&Rng::new(1), 0, &mut out, 0.02, f);
        });
        println!("{name:<6} {one:>10.2} {all:>14.2}");
        rows.push((one, all));
    }
    println!("speed-up {:>9.1}x {:>13.1}x", rows[0].0 / rows[1].0, rows[0].1 / rows[1].1);
}

fn check(n: u64) {
    const BLOCK: u64 = 1 << 24;
    let (mut a, mut b) = (vec![0f32; BLOCK as usize], vec![0f32; BLOCK as usize]);
    let (mut done, mut mismatches, mut fallbacks) = (0u64, 0u64, 0usize);
    let t = Instant::now();
    for block in 0.. {
        if done >= n {
            break;
        }
        let len = BLOCK.min(n - done) as usize;
        // A new seed every three blocks, each std in turn; each block starts where the last
        // one of its seed ended.
        let (seed, std) = (block / 3, STDS[block as usize % 3]);
        let first = (block % 3) * BLOCK;
        par_fill(&Rng::new(seed), first, &mut a[..len], std, fill_exact);
        fallbacks += par_fill(&Rng::new(seed), first, &mut b[..len], std, fill);
        mismatches += a[..len].iter().zip(&b[..len]).filter(|(x, y)| x.to_bits() != y.to_bits()).count() as u64;
        done += len as u64;
    }
    println!(
        "{done} normals compared in {:.1} s: {mismatches} mismatches, {fallbacks} recomputed exactly (1 in {:.0})",
        t.elapsed().as_secs_f64(),
        done as f64 / fallbacks.max(1) as f64
    );
    if mismatches > 0 {
        std::process::exit(1);
    }
}

fn main() {
    let args = Args::parse();
    match args.command {
        Some(Command::Check { n }) => check(n),
        None => bench(args.n),
    }
}
