//! The launch environment of one rank: torchrun's variables, read and checked, and the
//! environments a launcher gives N ranks on one host.
//!
//! A process started by `torchrun` (or any launcher that follows its convention) finds
//! `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` in its environment:
//! all five, or none (a plain single-process run). Reading goes through a lookup function so
//! that tests pass a map instead of touching the process environment.

use std::collections::HashMap;
use std::net::{Ipv4Addr, TcpListener};

/// The variables, in the order messages list them.
pub const LAUNCH_VARS: [&str; 5] = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"];

/// The most ranks [`local_spawn_plan`] starts on one host: more than any machine has GPUs, few
/// enough that a typo does not fork thousands of processes.
pub const MAX_LOCAL_RANKS: usize = 64;

/// One rank's place in a data-parallel run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the run (all hosts), ≥ 1.
    pub world_size: usize,
    /// This process's rank on its host (its GPU index), ≤ `rank`.
    pub local_rank: usize,
    /// Host name or address where rank 0 serves the rendezvous.
    pub master_addr: String,
    /// The rendezvous port, 1..=65535.
    pub master_port: u16,
}

impl LaunchEnv {
    /// Reads the five variables through `get`: `Ok(None)` when none is set, the checked
    /// environment when all are, and an error naming the variable and its allowed range
    /// otherwise (some missing, not a number, out of range).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>, String> {
        let values: Vec<Option<String>> = LAUNCH_VARS.iter().map(|v| get(v)).collect();
        let missing: Vec<&str> = LAUNCH_VARS.iter().zip(&values).filter(|(_, x)| x.is_none()).map(|(v, _)| *v).collect();
        if missing.len() == LAUNCH_VARS.len() {
            return Ok(None);
        }
        if !missing.is_empty() {
            let set: Vec<&str> = LAUNCH_VARS.iter().zip(&values).filter(|(_, x)| x.is_some()).map(|(v, _)| *v).collect();
            return Err(format!(
                "launch environment: {} set but {} missing (set all five of {} for a multi-process run, or none)",
                set.join(", "),
                missing.join(", "),
                LAUNCH_VARS.join(", ")
            ));
        }
        let val = |i: usize| values[i].as_deref().expect("all present");
        let whole = |name: &str, s: &str, range: &str| -> Result<u64, String> {
            s.parse::<u64>().map_err(|_| format!("launch environment: {name}={s:?} is not a whole number (allowed: {range})"))
        };
        let world = whole("WORLD_SIZE", val(1), "1 or more")?;
        if world == 0 {
            return Err("launch environment: WORLD_SIZE=0 is out of range (allowed: 1 or more)".to_string());
        }
        let rank_range = format!("0..={}, below WORLD_SIZE={world}", world - 1);
        let rank = whole("RANK", val(0), &rank_range)?;
        if rank >= world {
            return Err(format!("launch environment: RANK={rank} is out of range (allowed: {rank_range})"));
        }
        let local_range = format!("0..={rank}, at most RANK={rank}");
        let local_rank = whole("LOCAL_RANK", val(2), &local_range)?;
        if local_rank > rank {
            return Err(format!("launch environment: LOCAL_RANK={local_rank} is out of range (allowed: {local_range})"));
        }
        let master_addr = val(3).trim().to_string();
        if master_addr.is_empty() {
            return Err("launch environment: MASTER_ADDR is empty (allowed: a host name or IP address)".to_string());
        }
        let port = whole("MASTER_PORT", val(4), "1..=65535")?;
        if !(1..=65535).contains(&port) {
            return Err(format!("launch environment: MASTER_PORT={port} is out of range (allowed: 1..=65535)"));
        }
        Ok(Some(LaunchEnv {
            rank: rank as usize,
            world_size: world as usize,
            local_rank: local_rank as usize,
            master_addr,
            master_port: port as u16,
        }))
    }

    /// [`LaunchEnv::from_lookup`] over a map of variables.
    pub fn from_map(vars: &HashMap<String, String>) -> Result<Option<LaunchEnv>, String> {
        LaunchEnv::from_lookup(|k| vars.get(k).cloned())
    }

    /// [`LaunchEnv::from_lookup`] over this process's environment.
    pub fn from_process_env() -> Result<Option<LaunchEnv>, String> {
        LaunchEnv::from_lookup(|k| std::env::var(k).ok())
    }

    /// `MASTER_ADDR:MASTER_PORT`, bracketing an IPv6 address (`[::1]:29500`).
    pub fn master_endpoint(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }

    /// The five variables with this environment's values, in [`LAUNCH_VARS`] order: what a
    /// launcher sets in a child's environment.
    pub fn to_vars(&self) -> Vec<(&'static str, String)> {
        vec![
            ("RANK", self.rank.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("LOCAL_RANK", self.local_rank.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
        ]
    }
}

/// A free TCP port on 127.0.0.1, found by binding port 0 and letting the listener go. Another
/// process may take it before rank 0 binds it (as with torchrun's free port); rank 0 then fails
/// to bind with an error naming the port.
pub fn free_local_port() -> Result<u16, String> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| format!("cannot find a free local port: {e}"))?;
    listener.local_addr().map(|a| a.port()).map_err(|e| format!("cannot find a free local port: {e}"))
}

/// The environments of `n` ranks on this host (`--gpus n`), rendezvous on `127.0.0.1:port`:
/// child `i` gets `RANK=i`, `LOCAL_RANK=i`, `WORLD_SIZE=n`.
pub fn local_spawn_plan_on(n: usize, port: u16) -> Result<Vec<LaunchEnv>, String> {
    if !(1..=MAX_LOCAL_RANKS).contains(&n) {
        return Err(format!("local ranks: {n} is out of range (allowed: 1..={MAX_LOCAL_RANKS})"));
    }
    if port == 0 {
        return Err("local ranks: port 0 is out of range (allowed: 1..=65535)".to_string());
    }
    Ok((0..n)
        .map(|i| LaunchEnv { rank: i, world_size: n, local_rank: i, master_addr: Ipv4Addr::LOCALHOST.to_string(), master_port: port })
        .collect())
}

/// [`local_spawn_plan_on`] on a port found by [`free_local_port`].
pub fn local_spawn_plan(n: usize) -> Result<Vec<LaunchEnv>, String> {
    local_spawn_plan_on(n, free_local_port()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Result<Option<LaunchEnv>, String> {
        LaunchEnv::from_map(&pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    fn full(rank: &str, world: &str, local: &str, addr: &str, port: &str) -> Result<Option<LaunchEnv>, String> {
        env(&[("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", local), ("MASTER_ADDR", addr), ("MASTER_PORT", port)])
    }

    #[test]
    fn all_or_none() {
        assert_eq!(env(&[]), Ok(None));
        assert_eq!(env(&[("PATH", "/bin")]), Ok(None));
        let e = env(&[("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(e.contains("RANK, WORLD_SIZE set but LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing"), "{e}");
        let got = full("5", "8", "1", "node0.cluster", "29500").unwrap().unwrap();
        assert_eq!(got, LaunchEnv { rank: 5, world_size: 8, local_rank: 1, master_addr: "node0.cluster".into(), master_port: 29500 });
        assert_eq!(got.master_endpoint(), "node0.cluster:29500");
    }

    #[test]
    fn errors_name_the_variable_and_range() {
        let cases = [
            (full("2", "2", "0", "h", "1"), "RANK=2 is out of range (allowed: 0..=1, below WORLD_SIZE=2)"),
            (full("-1", "2", "0", "h", "1"), "RANK=\"-1\" is not a whole number (allowed: 0..=1"),
            (full("0", "0", "0", "h", "1"), "WORLD_SIZE=0 is out of range (allowed: 1 or more)"),
            (full("0", "two", "0", "h", "1"), "WORLD_SIZE=\"two\" is not a whole number"),
            (full("1", "4", "2", "h", "1"), "LOCAL_RANK=2 is out of range (allowed: 0..=1, at most RANK=1)"),
            (full("0", "1", "0", "h", "0"), "MASTER_PORT=0 is out of range (allowed: 1..=65535)"),
            (full("0", "1", "0", "h", "65536"), "MASTER_PORT=65536 is out of range"),
            (full("0", "1", "0", "h", "80x"), "MASTER_PORT=\"80x\" is not a whole number (allowed: 1..=65535)"),
            (full("0", "1", "0", " ", "1"), "MASTER_ADDR is empty"),
        ];
        for (got, want) in cases {
            let e = got.unwrap_err();
            assert!(e.contains(want), "{e:?} should contain {want:?}");
        }
        // The edges that are allowed.
        assert!(full("0", "1", "0", "h", "65535").unwrap().is_some());
        assert!(full("3", "4", "3", "h", "1").unwrap().is_some());
    }

    #[test]
    fn spawn_plan_round_trips() {
        let plan = local_spawn_plan(4).unwrap();
        assert_eq!(plan.len(), 4);
        let port = plan[0].master_port;
        assert_ne!(port, 0);
        for (i, child) in plan.iter().enumerate() {
            assert_eq!((child.rank, child.local_rank, child.world_size, child.master_port), (i, i, 4, port));
            assert_eq!(child.master_endpoint(), format!("127.0.0.1:{port}"));
            // What a child sets is what a child reads back.
            let vars: HashMap<String, String> = child.to_vars().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            assert_eq!(LaunchEnv::from_map(&vars).unwrap().as_ref(), Some(child));
        }
        assert_eq!(local_spawn_plan_on(1, 29500).unwrap().len(), 1);
        assert!(local_spawn_plan_on(0, 29500).unwrap_err().contains("allowed: 1..=64"));
        assert!(local_spawn_plan_on(65, 29500).is_err());
        assert!(local_spawn_plan_on(2, 0).is_err());
        // The free port really is bindable.
        assert!(TcpListener::bind((Ipv4Addr::LOCALHOST, free_local_port().unwrap())).is_ok());
    }

    #[test]
    fn ipv6_endpoint() {
        let e = LaunchEnv { rank: 0, world_size: 1, local_rank: 0, master_addr: "::1".into(), master_port: 7 };
        assert_eq!(e.master_endpoint(), "[::1]:7");
    }
}
