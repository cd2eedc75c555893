//! NVRTC in child processes. libnvrtc compiles one program at a time per process: on the H100
//! host, 2 threads took ~50 ms a module and 16 threads ~370 ms, the same ~0.5 s for a cold
//! GPT-2 124M build either way. So a binary that calls [`enable`] (fusec does, at start-up)
//! spreads a cold build's modules over a few children of itself (`fusec nvrtc-worker`), each
//! taking the next module when it is free; [`serve`] is the child's side. `fusec run --target cuda`
//! starts them at once ([`prestart`]), so their loading of libnvrtc overlaps the driver's.
//!
//! Protocol, over the child's stdin and stdout: a request is the architecture, the module name
//! and its source, each as a little-endian `u64` length and the bytes; the answer is a status byte (0: CUBIN, 1:
//! PTX, 2: error text) then the payload the same way. End of input ends the child. A worker that
//! cannot be started or dies leaves its modules to the in-process path.

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::{compile, Image};

static WORKER: OnceLock<PathBuf> = OnceLock::new();
/// Children started ahead of the build ([`prestart`]), waiting for requests.
static READY: Mutex<Vec<Worker>> = Mutex::new(Vec::new());

/// Child processes a cold build uses at most: half the cores, at most 8 (`FUSEC_NVRTC_PROCS`
/// overrides; 0 or 1: compile in this process). Measured for GPT-2 124M's modules: on the H100
/// host (16 cores), NVRTC 575 ms in this process, 330 ms with 2 children, 202 ms with 4, 229 ms
/// with 8; in the first process of a freshly started 2 × H200 machine (32 cores), where every
/// compile is several times slower, 3,337 ms with 2, 2,353 ms with 4, 1,587 ms with 8.
fn procs() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let want = std::env::var("FUSEC_NVRTC_PROCS").ok().and_then(|v| v.parse().ok()).unwrap_or((cores / 2).min(8));
    if WORKER.get().is_none() || want < 2 {
        0
    } else {
        want
    }
}

/// A compile result and the time it took.
pub(super) type Compiled = (Result<Image, String>, Duration);

/// Lets cold builds compile in children running `exe nvrtc-worker`.
pub fn enable(exe: PathBuf) {
    let _ = WORKER.set(exe);
}

/// Starts the children now, so that loading libnvrtc (seconds from a cold disk) overlaps the
/// driver's start-up and the passes; children not needed by the build are closed by it.
pub fn prestart() {
    let n = procs();
    let mut ready = READY.lock().unwrap_or_else(|e| e.into_inner());
    while ready.len() < n {
        match Worker::spawn() {
            Some(w) => ready.push(w),
            None => break,
        }
    }
}

/// A child process and its pipes.
struct Worker {
    child: Child,
    to: ChildStdin,
    from: BufReader<ChildStdout>,
}

impl Worker {
    fn spawn() -> Option<Worker> {
        let exe = WORKER.get()?;
        let mut child =
            Command::new(exe).arg("nvrtc-worker").stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().ok()?;
        let (to, from) = (child.stdin.take()?, child.stdout.take()?);
        Some(Worker { child, to, from: BufReader::new(from) })
    }

    /// Compiles one module; `Err` when the pipe broke (the caller falls back).
    fn compile(&mut self, arch: &str, name: &str, source: &str) -> std::io::Result<Result<Image, String>> {
        for part in [arch, name, source] {
            write_blob(&mut self.to, part.as_bytes())?;
        }
        self.to.flush()?;
        let mut status = [0u8];
        self.from.read_exact(&mut status)?;
        let payload = read_blob(&mut self.from)?.ok_or(std::io::ErrorKind::UnexpectedEof)?;
        Ok(match status[0] {
            2 => Err(String::from_utf8_lossy(&payload).into_owned()),
            s => Ok(Image { bytes: payload, ptx: s == 1 }),
        })
    }

    /// Ends the child: end of input, then wait.
    fn close(self) {
        let Worker { mut child, to, .. } = self;
        drop(to);
        let _ = child.wait();
    }
}

/// The child's loop: loads libnvrtc, then answers requests until its input ends.
pub fn serve() -> Result<(), String> {
    let _ = super::version();
    let (mut input, mut out) = (BufReader::new(std::io::stdin().lock()), BufWriter::new(std::io::stdout().lock()));
    while let Some(arch) = read_blob(&mut input).map_err(|e| e.to_string())? {
        let mut next = || read_blob(&mut input).map_err(|e| e.to_string())?.ok_or_else(|| "a request cut short".to_string());
        let (name, source) = (next()?, next()?);
        let (arch, name, source) = (String::from_utf8_lossy(&arch), String::from_utf8_lossy(&name), String::from_utf8_lossy(&source));
        let (status, payload) = match compile(&source, &name, &arch) {
            Ok(img) => (img.ptx as u8, img.bytes),
            Err(e) => (2, e.into_bytes()),
        };
        out.write_all(&[status]).and_then(|_| write_blob(&mut out, &payload)).and_then(|_| out.flush()).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Compiles `items` (name, source) in child processes and closes every child; `None` when
/// workers are off or there are fewer than two modules. Each child takes the next module of
/// `items` as soon as it is free (so put the slowest first: see [`super::compile_cost`]). A
/// module whose worker failed comes back as `None` in its slot.
pub(super) fn compile_all(items: &[(&str, &str)], arch: &str) -> Option<Vec<Option<Compiled>>> {
    let mut workers: Vec<Worker> = std::mem::take(&mut *READY.lock().unwrap_or_else(|e| e.into_inner()));
    let n = procs().min(items.len());
    if n < 2 {
        workers.into_iter().for_each(Worker::close);
        return None;
    }
    for w in workers.drain(n.min(workers.len())..) {
        w.close();
    }
    while workers.len() < n {
        workers.push(Worker::spawn()?);
    }
    let next = AtomicUsize::new(0);
    let mut out: Vec<Option<Compiled>> = (0..items.len()).map(|_| None).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = workers
            .into_iter()
            .map(|mut w| {
                let next = &next;
                scope.spawn(move || {
                    let mut done = vec![];
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(name, source)) = items.get(i) else { break };
                        let t0 = Instant::now();
                        match w.compile(arch, name, source) {
                            Ok(r) => done.push((i, (r, t0.elapsed()))),
                            Err(_) => break,
                        }
                    }
                    w.close();
                    done
                })
            })
            .collect();
        for h in handles {
            for (i, r) in h.join().unwrap_or_default() {
                out[i] = Some(r);
            }
        }
    });
    Some(out)
}

fn write_blob(w: &mut impl Write, b: &[u8]) -> std::io::Result<()> {
    w.write_all(&(b.len() as u64).to_le_bytes())?;
    w.write_all(b)
}

/// The next length-prefixed blob, or `None` at a clean end of input.
fn read_blob(r: &mut impl Read) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 8];
    match r.read_exact(&mut len) {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        r => r?,
    }
    let n = u64::from_le_bytes(len);
    if n > 1 << 30 {
        return Err(std::io::Error::other(format!("a {n}-byte message")));
    }
    let mut b = vec![0u8; n as usize];
    r.read_exact(&mut b)?;
    Ok(Some(b))
}
