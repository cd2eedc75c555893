//! The rendezvous on localhost: ranks as threads, fake peers as raw sockets. Short timeouts
//! keep every test well under 5 s.

use super::*;
use crate::dist::launch_env::{free_local_port, local_spawn_plan_on};
use std::thread;

const SHORT: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(3);

fn blob() -> UniqueId {
    let mut b = [0u8; BLOB_BYTES];
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i * 7 + 3) as u8;
    }
    b
}

fn server(world: usize) -> (RendezvousServer, String) {
    let s = RendezvousServer::bind("127.0.0.1:0", world).unwrap();
    let addr = s.local_addr().to_string();
    (s, addr)
}

fn spawn_join(addr: &str, rank: usize, world: usize, timeout: Duration) -> thread::JoinHandle<Result<UniqueId, RendezvousError>> {
    let addr = addr.to_string();
    thread::spawn(move || join(&addr, rank, world, timeout))
}

#[test]
fn four_ranks_get_the_same_blob() {
    let (s, addr) = server(4);
    let peers: Vec<_> = (1..4).map(|r| spawn_join(&addr, r, 4, LONG)).collect();
    s.serve(&blob(), LONG).unwrap();
    for p in peers {
        assert_eq!(p.join().unwrap().unwrap(), blob());
    }
}

#[test]
fn peers_started_before_rank_0() {
    let port = free_local_port().unwrap();
    let envs = local_spawn_plan_on(3, port).unwrap();
    let peers: Vec<_> = envs[1..]
        .iter()
        .cloned()
        .map(|env| thread::spawn(move || rendezvous(&env, || panic!("only rank 0 makes the blob"), LONG)))
        .collect();
    thread::sleep(Duration::from_millis(200));
    let got = rendezvous(&envs[0], blob, LONG).unwrap();
    assert_eq!(got, blob());
    for p in peers {
        assert_eq!(p.join().unwrap().unwrap(), blob());
    }
}

#[test]
fn world_of_one_needs_nobody() {
    let (s, _) = server(1);
    s.serve(&blob(), SHORT).unwrap();
}

#[test]
fn a_rank_that_never_comes_is_named() {
    let (s, addr) = server(4);
    let peers: Vec<_> = [1, 3].iter().map(|&r| spawn_join(&addr, r, 4, LONG)).collect();
    let t = Instant::now();
    let e = s.serve(&blob(), SHORT).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(2));
    match &e {
        RendezvousError::Missing { missing, silent, .. } => {
            assert_eq!(missing, &vec![2]);
            assert!(silent.is_empty());
        }
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("rank 2 never arrived"), "{e}");
    // The ranks that came are told, and stop with the same reason.
    for p in peers {
        let pe = p.join().unwrap().unwrap_err();
        assert!(matches!(pe, RendezvousError::Refused { .. }), "{pe:?}");
        assert!(pe.to_string().contains("rank 2 never arrived"), "{pe}");
    }
}

#[test]
fn a_silent_peer_cannot_hang_rank_0() {
    let (s, addr) = server(3);
    let silent = TcpStream::connect(&addr).unwrap();
    // Half a hello is as silent as none.
    let mut half = TcpStream::connect(&addr).unwrap();
    half.write_all(&hello(2, 3)[..10]).unwrap();
    let t = Instant::now();
    let e = s.serve(&blob(), SHORT).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(2), "took {:?}", t.elapsed());
    match &e {
        RendezvousError::Missing { missing, silent: quiet, .. } => {
            assert_eq!(missing, &vec![1, 2]);
            assert_eq!(quiet.len(), 2);
            assert!(quiet.contains(&silent.local_addr().unwrap()));
        }
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("ranks 1, 2 never arrived (2 connection(s) from"), "{e}");
}

#[test]
fn wrong_world_size_is_refused_on_both_sides() {
    let (s, addr) = server(3);
    let peer = spawn_join(&addr, 1, 4, LONG);
    let t = Instant::now();
    let e = s.serve(&blob(), LONG).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(2), "a bad hello fails at once");
    assert!(matches!(e, RendezvousError::BadHello { rank: 1, .. }), "{e:?}");
    assert!(e.to_string().contains("rank 1 (from 127.0.0.1:"), "{e}");
    assert!(e.to_string().contains("has WORLD_SIZE=4 but rank 0 has WORLD_SIZE=3"), "{e}");
    let pe = peer.join().unwrap().unwrap_err();
    assert!(pe.to_string().contains("refused: rendezvous failed at rank 0: rendezvous: rank 1"), "{pe}");
}

#[test]
fn duplicate_rank_is_refused() {
    let (s, addr) = server(3);
    let first = spawn_join(&addr, 2, 3, LONG);
    let second = spawn_join(&addr, 2, 3, LONG);
    let e = s.serve(&blob(), LONG).unwrap_err();
    assert!(e.to_string().contains("rank 2 connected twice (first from 127.0.0.1:"), "{e}");
    for p in [first, second] {
        assert!(matches!(p.join().unwrap().unwrap_err(), RendezvousError::Refused { rank: 2, .. }));
    }
}

#[test]
fn wrong_magic_version_and_rank_are_refused() {
    type Spoil = Box<dyn Fn(&mut [u8; HELLO_BYTES])>;
    let cases: [(Spoil, &str); 4] = [
        (Box::new(|h: &mut [u8; HELLO_BYTES]| h[..8].copy_from_slice(b"GET / HT")), "rank 1 (from"),
        (
            Box::new(|h: &mut [u8; HELLO_BYTES]| h[8..12].copy_from_slice(&7u32.to_le_bytes())),
            "speaks rendezvous protocol version 7, rank 0 speaks 1",
        ),
        (
            Box::new(|h: &mut [u8; HELLO_BYTES]| h[12..16].copy_from_slice(&0u32.to_le_bytes())),
            "rank 0 is out of range for a peer (allowed: 1..=2)",
        ),
        (Box::new(|h: &mut [u8; HELLO_BYTES]| h[12..16].copy_from_slice(&9u32.to_le_bytes())), "rank 9 is out of range"),
    ];
    for (spoil, want) in cases {
        let (s, addr) = server(3);
        let mut h = hello(1, 3);
        spoil(&mut h);
        let mut raw = TcpStream::connect(&addr).unwrap();
        raw.write_all(&h).unwrap();
        let e = s.serve(&blob(), LONG).unwrap_err();
        assert!(matches!(e, RendezvousError::BadHello { .. }), "{e:?}");
        assert!(e.to_string().contains(want), "{e} should contain {want}");
        // The offender hears why: status 1 and the message.
        let mut status = [0u8; 1];
        raw.read_exact(&mut status).unwrap();
        assert_eq!(status[0], 1);
    }
}

#[test]
fn rank_0_gone_is_named_by_the_peer() {
    let port = free_local_port().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let t = Instant::now();
    let e = join(&addr, 1, 2, SHORT).unwrap_err();
    assert!(t.elapsed() >= SHORT && t.elapsed() < Duration::from_secs(2), "took {:?}", t.elapsed());
    assert!(matches!(e, RendezvousError::Unreachable { .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.contains(&format!("rank 1 could not reach rank 0 at MASTER_ADDR:MASTER_PORT = {addr} within")), "{text}");
}

#[test]
fn rank_0_that_never_answers_times_out() {
    // A listener that accepts (the kernel does) but never answers.
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = mute.local_addr().unwrap().to_string();
    let t = Instant::now();
    let e = join(&addr, 1, 2, SHORT).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(3), "took {:?}", t.elapsed());
    assert!(e.to_string().contains("did not answer within 1300 ms"), "{e}");
    drop(mute);
}

#[test]
fn bad_arguments() {
    assert!(matches!(RendezvousServer::bind("127.0.0.1:0", 0), Err(RendezvousError::Invalid(_))));
    assert!(matches!(join("127.0.0.1:1", 0, 2, SHORT), Err(RendezvousError::Invalid(_))));
    assert!(matches!(join("127.0.0.1:1", 2, 2, SHORT), Err(RendezvousError::Invalid(_))));
    assert!(matches!(join("127.0.0.1:1", 1, 1, SHORT), Err(RendezvousError::Invalid(_))));
    // A port that is taken cannot be bound; the error names the address.
    let (_s, addr) = server(2);
    let e = RendezvousServer::bind(&addr, 2).err().unwrap();
    assert!(e.to_string().contains(&format!("cannot listen on MASTER_ADDR:MASTER_PORT = {addr}")), "{e}");
}
