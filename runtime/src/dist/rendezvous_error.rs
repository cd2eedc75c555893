//! Why a rendezvous failed, in words that name the ranks and the address concerned.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

/// Why a rendezvous failed. The `Display` text names the ranks and the address concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RendezvousError {
    /// The arguments contradict each other (rank outside the world, world size 0).
    Invalid(String),
    /// Rank 0 could not listen on the address.
    Bind {
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// The system's reason.
        reason: String,
    },
    /// Rank 0: not every peer said hello before the deadline.
    Missing {
        /// How long rank 0 waited.
        waited: Duration,
        /// The ranks that sent no hello.
        missing: Vec<usize>,
        /// Connections that were open but had not sent a whole hello.
        silent: Vec<SocketAddr>,
    },
    /// Rank 0: a peer's hello was wrong.
    BadHello {
        /// Where the connection came from.
        from: SocketAddr,
        /// The rank the hello claims.
        rank: u32,
        /// What is wrong with it.
        reason: String,
    },
    /// Rank 0: the blob could not be sent to a peer.
    Send {
        /// The peer's rank.
        rank: usize,
        /// The system's reason.
        reason: String,
    },
    /// A peer: no connection to rank 0 within the deadline.
    Unreachable {
        /// The peer's own rank.
        rank: usize,
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// How long it tried.
        waited: Duration,
        /// The last connection attempt's error.
        last_error: String,
    },
    /// A peer: connected, but no valid answer came.
    NoAnswer {
        /// The peer's own rank.
        rank: usize,
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// What happened instead.
        reason: String,
    },
    /// A peer: rank 0 answered with an error.
    Refused {
        /// The peer's own rank.
        rank: usize,
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// Rank 0's message.
        reason: String,
    },
}

pub(super) fn ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}

fn rank_list(ranks: &[usize]) -> String {
    let names: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    format!("{} {}", if ranks.len() == 1 { "rank" } else { "ranks" }, names.join(", "))
}

impl fmt::Display for RendezvousError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use RendezvousError::*;
        match self {
            Invalid(m) => write!(f, "rendezvous: {m}"),
            Bind { addr, reason } => write!(f, "rendezvous: rank 0 cannot listen on MASTER_ADDR:MASTER_PORT = {addr}: {reason}"),
            Missing { waited, missing, silent } => {
                write!(f, "rendezvous: rank 0 waited {} for all ranks; {} never arrived", ms(*waited), rank_list(missing))?;
                if !silent.is_empty() {
                    let from: Vec<String> = silent.iter().map(|a| a.to_string()).collect();
                    write!(f, " ({} connection(s) from {} opened but sent no hello)", silent.len(), from.join(", "))?;
                }
                Ok(())
            }
            BadHello { from, rank, reason } => write!(f, "rendezvous: rank {rank} (from {from}): {reason}"),
            Send { rank, reason } => write!(f, "rendezvous: rank 0 could not send the id to rank {rank}: {reason}"),
            Unreachable { rank, addr, waited, last_error } => write!(
                f,
                "rendezvous: rank {rank} could not reach rank 0 at MASTER_ADDR:MASTER_PORT = {addr} within {} (last error: {last_error})",
                ms(*waited)
            ),
            NoAnswer { rank, addr, reason } => write!(f, "rendezvous: rank {rank}: rank 0 at {addr} {reason}"),
            Refused { rank, addr, reason } => write!(f, "rendezvous: rank {rank}: rank 0 at {addr} refused: {reason}"),
        }
    }
}

impl std::error::Error for RendezvousError {}

impl From<RendezvousError> for String {
    fn from(e: RendezvousError) -> String {
        e.to_string()
    }
}
