//! The rendezvous: rank 0 hands a 128-byte blob (the NCCL unique id) to every other rank over
//! TCP on `MASTER_ADDR:MASTER_PORT`, std::net only.
//!
//! Protocol (version 1, little-endian). A peer connects, retrying until its deadline since
//! rank 0 may start later, and sends a 20-byte hello: the magic `fusecRDV`, the protocol
//! version (u32), its rank (u32) and the world size (u32). Rank 0 checks each hello (magic,
//! version, rank in `1..world`, no rank twice, the same world size) and, once all `world - 1`
//! peers are there, answers each with `0` followed by the blob. On any failure it answers every
//! connected peer with `1`, a length (u32) and the message, so that all ranks stop with the same
//! reason. Rank 0 polls non-blocking sockets against one deadline, so a peer that connects and
//! never says anything delays nothing and cannot hang it; a peer waits for the answer at most
//! its timeout plus one second (rank 0 answers within its own timeout, which began before the
//! peer could connect).

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::thread::sleep;
use std::time::{Duration, Instant};

use super::launch_env::LaunchEnv;

/// Size of the blob rank 0 serves (`ncclUniqueId` is 128 bytes).
pub const BLOB_BYTES: usize = 128;
/// The blob: an NCCL unique id.
pub type UniqueId = [u8; BLOB_BYTES];
/// The first bytes of every hello.
pub const MAGIC: [u8; 8] = *b"fusecRDV";
/// The protocol version this build speaks.
pub const VERSION: u32 = 1;
/// How long ranks wait for each other by default (ranks of a large run may start minutes apart).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

const HELLO_BYTES: usize = 20;
const POLL: Duration = Duration::from_millis(2);
const RETRY: Duration = Duration::from_millis(20);
const ANSWER_GRACE: Duration = Duration::from_secs(1);
const MAX_MESSAGE: usize = 4096;

#[path = "rendezvous_error.rs"]
mod error;
use error::ms;
pub use error::RendezvousError;

/// Rank 0's side: a bound listener, waiting to serve.
pub struct RendezvousServer {
    listener: TcpListener,
    world: usize,
}

/// A connection that has not yet sent its whole hello.
struct Pending {
    stream: TcpStream,
    from: SocketAddr,
    hello: Vec<u8>,
}

/// A peer whose hello was accepted.
struct Arrived {
    stream: TcpStream,
    from: SocketAddr,
}

impl RendezvousServer {
    /// Listens on `addr` (`MASTER_ADDR:MASTER_PORT`; port 0 picks a free one) for a run of
    /// `world` ranks.
    pub fn bind(addr: &str, world: usize) -> Result<RendezvousServer, RendezvousError> {
        if world == 0 {
            return Err(RendezvousError::Invalid("world size 0 (at least 1 rank is needed)".into()));
        }
        let bind_err = |e: std::io::Error| RendezvousError::Bind { addr: addr.to_string(), reason: e.to_string() };
        let listener = TcpListener::bind(addr).map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        Ok(RendezvousServer { listener, world })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    /// Waits until every peer (ranks `1..world`) has said hello, then sends each the blob.
    /// Fails at the first bad hello, or after `timeout` naming the ranks that never arrived;
    /// connected peers are told why in both cases.
    pub fn serve(self, blob: &UniqueId, timeout: Duration) -> Result<(), RendezvousError> {
        let start = Instant::now();
        let deadline = start + timeout;
        let mut peers: Vec<Option<Arrived>> = (0..self.world).map(|_| None).collect();
        let mut pending: Vec<Pending> = Vec::new();
        let mut arrived = 0;
        while arrived + 1 < self.world {
            self.accept_all(&mut pending);
            let mut i = 0;
            while i < pending.len() {
                match read_hello(&mut pending[i]) {
                    HelloState::Incomplete => i += 1,
                    HelloState::Closed => drop(pending.swap_remove(i)),
                    HelloState::Complete => {
                        let p = pending.swap_remove(i);
                        match check_hello(&p, self.world, &peers) {
                            Ok(rank) => {
                                peers[rank] = Some(Arrived { stream: p.stream, from: p.from });
                                arrived += 1;
                            }
                            Err(e) => {
                                let mut told: Vec<TcpStream> = peers.into_iter().flatten().map(|a| a.stream).collect();
                                told.push(p.stream);
                                refuse_all(told, &e);
                                return Err(e);
                            }
                        }
                    }
                }
            }
            if arrived + 1 == self.world {
                break;
            }
            if Instant::now() >= deadline {
                let missing = (1..self.world).filter(|&r| peers[r].is_none()).collect();
                let e = RendezvousError::Missing { waited: start.elapsed(), missing, silent: pending.iter().map(|p| p.from).collect() };
                refuse_all(peers.into_iter().flatten().map(|a| a.stream).collect(), &e);
                return Err(e);
            }
            sleep(POLL);
        }
        for (rank, peer) in peers.into_iter().enumerate() {
            if let Some(mut p) = peer {
                let mut answer = Vec::with_capacity(1 + BLOB_BYTES);
                answer.push(0u8);
                answer.extend_from_slice(blob);
                send(&mut p.stream, &answer)
                    .map_err(|e| RendezvousError::Send { rank, reason: format!("{e} (connected from {})", p.from) })?;
            }
        }
        Ok(())
    }

    /// Takes every connection waiting on the listener.
    fn accept_all(&self, pending: &mut Vec<Pending>) {
        loop {
            match self.listener.accept() {
                Ok((stream, from)) => {
                    if stream.set_nonblocking(true).is_ok() {
                        pending.push(Pending { stream, from, hello: Vec::with_capacity(HELLO_BYTES) });
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                // WouldBlock: none waiting. Anything else (a connection reset before it was
                // accepted, out of descriptors) is retried at the next poll until the deadline.
                Err(_) => return,
            }
        }
    }
}

enum HelloState {
    Incomplete,
    Complete,
    Closed,
}

/// Reads what has arrived of a hello without blocking.
fn read_hello(p: &mut Pending) -> HelloState {
    let mut buf = [0u8; HELLO_BYTES];
    loop {
        let want = HELLO_BYTES - p.hello.len();
        match p.stream.read(&mut buf[..want]) {
            Ok(0) => return HelloState::Closed,
            Ok(n) => {
                p.hello.extend_from_slice(&buf[..n]);
                if p.hello.len() == HELLO_BYTES {
                    return HelloState::Complete;
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return HelloState::Incomplete,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return HelloState::Closed,
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// The hello a peer sends.
fn hello(rank: usize, world: usize) -> [u8; HELLO_BYTES] {
    let mut h = [0u8; HELLO_BYTES];
    h[..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(rank as u32).to_le_bytes());
    h[16..20].copy_from_slice(&(world as u32).to_le_bytes());
    h
}

/// The rank of a complete hello, or why it is refused.
fn check_hello(p: &Pending, world: usize, peers: &[Option<Arrived>]) -> Result<usize, RendezvousError> {
    let h = &p.hello;
    let rank = u32_at(h, 12);
    let bad = |reason: String| RendezvousError::BadHello { from: p.from, rank, reason };
    if h[..8] != MAGIC {
        return Err(bad(format!("wrong magic bytes {:02x?} (expected {:02x?}: not a fusec rendezvous client?)", &h[..8], MAGIC)));
    }
    let version = u32_at(h, 8);
    if version != VERSION {
        return Err(bad(format!("speaks rendezvous protocol version {version}, rank 0 speaks {VERSION}")));
    }
    let peer_world = u32_at(h, 16);
    if peer_world as usize != world {
        return Err(bad(format!("has WORLD_SIZE={peer_world} but rank 0 has WORLD_SIZE={world}")));
    }
    let r = rank as usize;
    if r == 0 || r >= world {
        return Err(bad(format!("rank {rank} is out of range for a peer (allowed: 1..={})", world - 1)));
    }
    if let Some(first) = &peers[r] {
        return Err(bad(format!("rank {rank} connected twice (first from {}, again from {})", first.from, p.from)));
    }
    Ok(r)
}

/// Writes `bytes` with a bounded wait.
fn send(stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(Duration::from_secs(1)))?;
    stream.write_all(bytes)?;
    stream.flush()
}

/// Tells every stream why the rendezvous failed (best effort: a peer that is gone is gone).
fn refuse_all(streams: Vec<TcpStream>, e: &RendezvousError) {
    let msg = format!("rendezvous failed at rank 0: {e}");
    let msg = &msg.as_bytes()[..msg.len().min(MAX_MESSAGE)];
    let mut answer = vec![1u8];
    answer.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    answer.extend_from_slice(msg);
    for mut s in streams {
        let _ = send(&mut s, &answer);
    }
}

/// A peer's side: connects to rank 0 at `addr` (retrying until `timeout`), says hello as
/// `rank` of `world`, and returns the blob once rank 0 has heard from every rank.
pub fn join(addr: &str, rank: usize, world: usize, timeout: Duration) -> Result<UniqueId, RendezvousError> {
    if world < 2 || rank == 0 || rank >= world || world > u32::MAX as usize {
        return Err(RendezvousError::Invalid(format!("rank {rank} of world size {world} is not a peer (allowed: 1..world, world ≥ 2)")));
    }
    let start = Instant::now();
    let deadline = start + timeout;
    let mut last_error = "no attempt".to_string();
    let mut stream = 'connect: loop {
        match addr.to_socket_addrs() {
            Ok(addrs) => {
                for a in addrs {
                    let left = deadline.saturating_duration_since(Instant::now()).clamp(Duration::from_millis(1), Duration::from_secs(1));
                    match TcpStream::connect_timeout(&a, left) {
                        Ok(s) => break 'connect s,
                        Err(e) => last_error = e.to_string(),
                    }
                }
            }
            Err(e) => last_error = format!("cannot resolve: {e}"),
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(RendezvousError::Unreachable { rank, addr: addr.to_string(), waited: start.elapsed(), last_error });
        }
        sleep(RETRY.min(deadline - now));
    };
    let no_answer = |reason: String| RendezvousError::NoAnswer { rank, addr: addr.to_string(), reason };
    let io = |what: &str, e: std::io::Error| no_answer(format!("{what}: {e}"));
    stream.set_write_timeout(Some(timeout.max(Duration::from_millis(1)))).map_err(|e| io("cannot set a write timeout", e))?;
    stream.write_all(&hello(rank, world)).map_err(|e| io("did not take the hello", e))?;
    let wait = timeout + ANSWER_GRACE;
    stream.set_read_timeout(Some(wait)).map_err(|e| io("cannot set a read timeout", e))?;
    let read = |stream: &mut TcpStream, buf: &mut [u8]| -> Result<(), RendezvousError> {
        stream.read_exact(buf).map_err(|e| match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => no_answer(format!("did not answer within {}", ms(wait))),
            ErrorKind::UnexpectedEof => no_answer("closed the connection without a complete answer".into()),
            _ => io("connection failed while waiting for the answer", e),
        })
    };
    let mut status = [0u8; 1];
    read(&mut stream, &mut status)?;
    match status[0] {
        0 => {
            let mut blob = [0u8; BLOB_BYTES];
            read(&mut stream, &mut blob)?;
            Ok(blob)
        }
        1 => {
            let mut len = [0u8; 4];
            read(&mut stream, &mut len)?;
            let len = (u32::from_le_bytes(len) as usize).min(MAX_MESSAGE);
            let mut msg = vec![0u8; len];
            read(&mut stream, &mut msg)?;
            Err(RendezvousError::Refused { rank, addr: addr.to_string(), reason: String::from_utf8_lossy(&msg).into_owned() })
        }
        s => Err(no_answer(format!("answered with unknown status byte {s} (not a fusec rendezvous server?)"))),
    }
}

/// The whole rendezvous for one rank of `env`: rank 0 listens on `MASTER_ADDR:MASTER_PORT`,
/// serves `make_blob()` and returns it; every other rank joins and returns what rank 0 served.
pub fn rendezvous(env: &LaunchEnv, make_blob: impl FnOnce() -> UniqueId, timeout: Duration) -> Result<UniqueId, RendezvousError> {
    let addr = env.master_endpoint();
    if env.rank == 0 {
        let blob = make_blob();
        RendezvousServer::bind(&addr, env.world_size)?.serve(&blob, timeout)?;
        Ok(blob)
    } else {
        join(&addr, env.rank, env.world_size, timeout)
    }
}

#[cfg(test)]
#[path = "rendezvous_tests.rs"]
mod tests;
