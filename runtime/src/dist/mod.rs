//! Data-parallel training: the start-up protocol and the collectives outside the IR.
//!
//! - [`launch_env`]: torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//!   `MASTER_PORT`) parsed and checked, and the environments of N ranks on one host;
//! - [`rendezvous`]: rank 0 hands a 128-byte blob (the NCCL unique id, or the CPU collective's
//!   port) to every other rank over TCP, with deadlines everywhere, so that a missing or silent
//!   rank is named, never waited for forever;
//! - [`nccl`]: a rank's NCCL communicator and its collectives, and `fusec nccl-check` (every
//!   visible GPU as one rank of this process, an all-reduce checked and timed);
//! - [`star`]: the CPU target's collective, through rank 0 over TCP.
//!
//! The buckets and the ZeRO-1 shards are IR (`passes/src/data_parallel.rs`, `passes/src/zero.rs`).

pub mod launch_env;
pub mod nccl;
pub mod rendezvous;
pub mod star;
