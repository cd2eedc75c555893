//! The CPU target's collective: the mean over the ranks of an f32 buffer, gathered at rank 0
//! over TCP and sent back (a star; PyTorch's gloo plays this part for its CPU tensors). GPUs
//! use NCCL instead ([`super::nccl`]); this exists so that data-parallel runs work, and are
//! tested, on machines without one.
//!
//! Start-up goes through the [`super::rendezvous`]: rank 0 listens for the data connections on a
//! free port first and serves that port as the blob; each peer connects and names its rank.
//! Every message is a 20-byte header (magic `fAR1`, the collective's sequence number, its
//! element count: u64s, little-endian) and the values. Rank 0 adds the peers' buffers to its
//! own in rank order and divides by the world size, so every rank gets the same bits, run after
//! run. A peer that stops closes its connection and one that hangs times out: either way the
//! others stop with an error naming it, never wait forever.

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::launch_env::LaunchEnv;
use super::rendezvous::{rendezvous, UniqueId, BLOB_BYTES};

/// The mean over the ranks of a buffer every rank holds (the `all_reduce` launch on the host).
pub trait HostCollective: Send {
    /// Replaces `buf` by the mean over the ranks of every rank's `buf` (equal lengths).
    fn all_reduce_mean(&mut self, buf: &mut [f32]) -> Result<(), String>;
    /// `buf` is consecutive segments of `(length, owner)`: replaces each segment by the owner
    /// rank's values of it (equal layouts on every rank).
    fn from_owners(&mut self, buf: &mut [f32], segments: &[(usize, usize)]) -> Result<(), String>;
}

const BLOB_MAGIC: &[u8; 8] = b"fusecTCP";
const HELLO_MAGIC: &[u8; 8] = b"fusecAR1";
const FRAME_MAGIC: &[u8; 4] = b"fAR1";
const HEADER: usize = 20;

/// Who this rank talks to.
enum Links {
    /// A one-rank run: nothing to talk to.
    Alone,
    /// Rank 0: the peers' connections, rank 1 first.
    Root(Vec<TcpStream>),
    /// Any other rank: its connection to rank 0.
    Peer(TcpStream),
}

/// [`HostCollective`] over TCP through rank 0.
pub struct TcpStar {
    rank: usize,
    world: usize,
    /// Collectives run so far (every rank runs the same sequence).
    seq: u64,
    links: Links,
    /// Rank 0's receive buffer.
    scratch: Vec<u8>,
}

impl TcpStar {
    /// Connects the ranks of `env`; `timeout` bounds the start-up and every later wait for
    /// another rank.
    pub fn connect(env: &LaunchEnv, timeout: Duration) -> Result<TcpStar, String> {
        let (rank, world) = (env.rank, env.world_size);
        let links = if world == 1 {
            Links::Alone
        } else if rank == 0 {
            let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(|e| format!("collective: cannot listen: {e}"))?;
            let port = listener.local_addr().map_err(|e| format!("collective: {e}"))?.port();
            rendezvous(env, || blob(port), timeout)?;
            Links::Root(accept_peers(&listener, world, timeout)?)
        } else {
            let port = port_of(&rendezvous(env, || [0; BLOB_BYTES], timeout)?)?;
            let addr = LaunchEnv { master_port: port, ..env.clone() }.master_endpoint();
            let mut s = TcpStream::connect(&addr).map_err(|e| format!("collective: rank {rank} cannot connect to rank 0 at {addr}: {e}"))?;
            let mut hello = HELLO_MAGIC.to_vec();
            hello.extend((rank as u64).to_le_bytes());
            s.write_all(&hello).map_err(|e| format!("collective: rank {rank} cannot reach rank 0: {e}"))?;
            Links::Peer(configure(s, timeout)?)
        };
        Ok(TcpStar { rank, world, seq: 0, links, scratch: vec![] })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
}

impl HostCollective for TcpStar {
    fn all_reduce_mean(&mut self, buf: &mut [f32]) -> Result<(), String> {
        let w = self.world as f32;
        self.exchange(
            buf,
            |acc, _, theirs| acc.iter_mut().zip(theirs).for_each(|(x, y)| *x += y),
            |acc| acc.iter_mut().for_each(|x| *x /= w),
        )
    }

    fn from_owners(&mut self, buf: &mut [f32], segments: &[(usize, usize)]) -> Result<(), String> {
        if segments.iter().map(|(len, _)| len).sum::<usize>() != buf.len() {
            return Err(format!("from_owners: segments of {} values over a buffer of {}", segments.iter().map(|s| s.0).sum::<usize>(), buf.len()));
        }
        let take = |acc: &mut [f32], rank: usize, theirs: &[f32]| {
            let mut at = 0;
            for &(len, owner) in segments {
                if owner == rank {
                    acc[at..at + len].copy_from_slice(&theirs[at..at + len]);
                }
                at += len;
            }
        };
        self.exchange(buf, take, |_| {})
    }
}

impl TcpStar {
    /// Rank 0 receives every peer's `buf` in rank order and folds each into its own with
    /// `combine(acc, rank, theirs)`, applies `finish`, and sends the result back: every rank
    /// ends with it.
    fn exchange(&mut self, buf: &mut [f32], combine: impl Fn(&mut [f32], usize, &[f32]), finish: impl Fn(&mut [f32])) -> Result<(), String> {
        let seq = self.seq;
        self.seq += 1;
        match &mut self.links {
            Links::Alone => Ok(()),
            Links::Root(peers) => {
                let mut theirs = vec![0f32; buf.len()];
                for (i, s) in peers.iter_mut().enumerate() {
                    let r = i + 1;
                    read_frame(s, r, seq, &mut theirs, &mut self.scratch)?;
                    combine(buf, r, &theirs);
                }
                finish(buf);
                let frame = frame(seq, buf);
                for (i, s) in peers.iter_mut().enumerate() {
                    s.write_all(&frame).map_err(|e| lost(i + 1, seq, &e))?;
                }
                Ok(())
            }
            Links::Peer(s) => {
                s.write_all(&frame(seq, buf)).map_err(|e| lost(0, seq, &e))?;
                read_frame(s, 0, seq, buf, &mut self.scratch)
            }
        }
    }
}

/// The blob rank 0 serves: the magic and the data port.
fn blob(port: u16) -> UniqueId {
    let mut b = [0; BLOB_BYTES];
    b[..8].copy_from_slice(BLOB_MAGIC);
    b[8..10].copy_from_slice(&port.to_le_bytes());
    b
}

fn port_of(b: &UniqueId) -> Result<u16, String> {
    if &b[..8] != BLOB_MAGIC {
        return Err("collective: rank 0 served no CPU collective (do all ranks run --target cpu?)".to_string());
    }
    Ok(u16::from_le_bytes([b[8], b[9]]))
}

/// Blocking reads and writes bounded by `timeout`, no Nagle delay.
fn configure(s: TcpStream, timeout: Duration) -> Result<TcpStream, String> {
    let set = || -> std::io::Result<()> {
        s.set_nonblocking(false)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))
    };
    set().map_err(|e| format!("collective: {e}"))?;
    Ok(s)
}

/// Rank 0 accepts one connection from each peer, each naming its rank, before `timeout`.
fn accept_peers(listener: &TcpListener, world: usize, timeout: Duration) -> Result<Vec<TcpStream>, String> {
    let deadline = Instant::now() + timeout;
    let mut peers: Vec<Option<TcpStream>> = (1..world).map(|_| None).collect();
    listener.set_nonblocking(true).map_err(|e| format!("collective: {e}"))?;
    while peers.iter().any(Option::is_none) {
        match listener.accept() {
            Ok((s, from)) => {
                let mut s = configure(s, deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)))?;
                let mut hello = [0u8; 16];
                s.read_exact(&mut hello).map_err(|e| format!("collective: {from} sent no hello: {e}"))?;
                let r = u64::from_le_bytes(hello[8..].try_into().expect("8 bytes")) as usize;
                if &hello[..8] != HELLO_MAGIC || !(1..world).contains(&r) || peers[r - 1].is_some() {
                    return Err(format!("collective: {from} sent a bad hello (rank {r} of {world})"));
                }
                peers[r - 1] = Some(configure(s, timeout)?);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> = (1..world).filter(|r| peers[r - 1].is_none()).map(|r| r.to_string()).collect();
                    return Err(format!("collective: rank(s) {} did not connect within {:.0} s", missing.join(", "), timeout.as_secs_f64()));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(format!("collective: accept: {e}")),
        }
    }
    Ok(peers.into_iter().flatten().collect())
}

fn frame(seq: u64, buf: &[f32]) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER + 4 * buf.len());
    f.extend(FRAME_MAGIC);
    f.extend(seq.to_le_bytes());
    f.extend((buf.len() as u64).to_le_bytes());
    buf.iter().for_each(|x| f.extend(x.to_le_bytes()));
    f
}

/// Reads rank `from`'s frame of collective `seq` (`out.len()` values) into `out`, through
/// `bytes`; an error says which rank stopped, hung or is elsewhere in the program.
fn read_frame(s: &mut TcpStream, from: usize, seq: u64, out: &mut [f32], bytes: &mut Vec<u8>) -> Result<(), String> {
    let n = out.len() as u64;
    let mut h = [0u8; HEADER];
    s.read_exact(&mut h).map_err(|e| lost(from, seq, &e))?;
    let (their_seq, their_n) = (u64::from_le_bytes(h[4..12].try_into().expect("8")), u64::from_le_bytes(h[12..20].try_into().expect("8")));
    if &h[..4] != FRAME_MAGIC || their_seq != seq || their_n != n {
        return Err(format!(
            "collective #{seq} ({n} values): rank {from} sent collective #{their_seq} of {their_n} values (the ranks run different programs)"
        ));
    }
    bytes.resize(4 * out.len(), 0);
    s.read_exact(bytes).map_err(|e| lost(from, seq, &e))?;
    for (x, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    Ok(())
}

/// Why rank `r` is gone.
fn lost(r: usize, seq: u64, e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            format!("collective #{seq}: rank {r} sent nothing before the timeout (it hangs or is far slower than the others)")
        }
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted => {
            format!("collective #{seq}: rank {r} closed its connection (it stopped: see its own error)")
        }
        _ => format!("collective #{seq}: rank {r}: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::launch_env::local_spawn_plan;

    /// Runs `f` on every rank of a local world of `n`, one thread each.
    fn world<T: Send + 'static>(n: usize, f: impl Fn(TcpStar) -> T + Send + Sync + Copy + 'static) -> Vec<T> {
        let plan = local_spawn_plan(n).unwrap();
        let threads: Vec<_> = plan
            .into_iter()
            .map(|env| std::thread::spawn(move || f(TcpStar::connect(&env, Duration::from_secs(10)).unwrap())))
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_gets_the_mean_in_rank_order() {
        let out = world(3, |mut c| {
            let r = c.rank() as f32;
            let mut a = vec![r, 10.0 * r, 0.1 + r];
            c.all_reduce_mean(&mut a).unwrap();
            let mut b = vec![1e8 * (r - 1.0), 1.0];
            c.all_reduce_mean(&mut b).unwrap();
            (a, b)
        });
        // The expected values summed in rank order in f32, then divided, as rank 0 does.
        let third = |xs: [f32; 3]| (xs[0] + xs[1] + xs[2]) / 3.0;
        let want_a = vec![third([0.0, 1.0, 2.0]), third([0.0, 10.0, 20.0]), third([0.1, 1.1, 2.1])];
        let want_b = vec![third([-1e8, 0.0, 1e8]), 1.0];
        for (a, b) in out {
            assert_eq!(a, want_a);
            assert_eq!(b, want_b);
        }
    }

    #[test]
    fn one_rank_is_the_identity() {
        let env = LaunchEnv { rank: 0, world_size: 1, local_rank: 0, master_addr: "127.0.0.1".into(), master_port: 1 };
        let mut c = TcpStar::connect(&env, Duration::from_secs(1)).unwrap();
        let mut a = vec![0.1f32, -3.0];
        c.all_reduce_mean(&mut a).unwrap();
        assert_eq!(a, vec![0.1f32, -3.0]);
    }

    #[test]
    fn a_rank_that_stops_or_disagrees_is_named() {
        let out = world(2, |mut c| {
            let mut a = vec![1.0f32; 4];
            if c.rank() == 1 {
                let mut short = vec![1.0f32; 3];
                return c.all_reduce_mean(&mut short).err();
            }
            c.all_reduce_mean(&mut a).err()
        });
        let root = out[0].clone().unwrap();
        assert!(root.contains("rank 1 sent collective #0 of 3 values"), "{root}");
        // Rank 0 gave up and dropped the connection: rank 1 is told rank 0 stopped.
        assert!(out[1].clone().unwrap().contains("rank 0 closed its connection"), "{:?}", out[1]);
    }

    #[test]
    fn a_rank_that_never_comes_is_a_timeout_not_a_hang() {
        let plan = local_spawn_plan(2).unwrap();
        let t0 = Instant::now();
        let e = TcpStar::connect(&plan[0], Duration::from_millis(300)).err().unwrap();
        assert!(e.contains("1"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5));
    }
}
