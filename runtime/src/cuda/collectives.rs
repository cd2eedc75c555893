//! Collectives on the GPU: the NCCL rank of a data-parallel run, its steps (`all_reduce`,
//! `from_owners`; copies without a communicator), and running them beside the backward.
//!
//! `schedule` places each bucket's `all_reduce` right after its last gradient; here an
//! in-place one runs on a second stream: the step's stream records an
//! event, the side stream waits for it, runs the NCCL group and records a second event, and
//! the step's stream goes on with the backward. The first launch that reads the averaged
//! gradients (AdamW, the clipping norm) waits for that second event, and the end of every
//! program waits for any still running (the host reads the loss; a CUDA graph's capture must
//! join its streams). Captured into the step's CUDA graph as fork and join edges. Timed and
//! synchronized runs (`--profile`, `FUSEC_CUDA_SYNC`) keep every launch on the step's stream.

use std::collections::HashMap;
use std::time::Duration;

use cudarc::driver::sys;
use fusec_ir::DType;

use super::comm_timing::{self, CommTiming};
use super::device::ck;
use super::launch::{Addr, Launch, Step};
use super::CudaExecutor;
use crate::dist::launch_env::LaunchEnv;
use crate::dist::nccl::NcclRank;
use crate::programs::Program;

/// The second stream and the two events of each side collective.
pub(super) struct SideStream {
    stream: sys::CUstream,
    /// (program, launch index) -> (step's stream reached it, the collective is done).
    events: HashMap<(Program, usize), [sys::CUevent; 2]>,
}

impl SideStream {
    /// A stream and events for every side collective of `programs`.
    pub(super) fn new<'a>(programs: impl Iterator<Item = (Program, &'a [Launch])>) -> Result<SideStream, String> {
        let mut stream = std::ptr::null_mut();
        // SAFETY: a new stream of the current context.
        unsafe { ck(sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32), "side stream")? };
        let mut side = SideStream { stream, events: HashMap::new() };
        let event = || cudarc::driver::result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| format!("event: {e:?}"));
        for (p, launches) in programs {
            for (i, _) in launches.iter().enumerate().filter(|(_, l)| l.side) {
                side.events.insert((p, i), [event()?, event()?]);
            }
        }
        Ok(side)
    }
}

impl Drop for SideStream {
    fn drop(&mut self) {
        // SAFETY: created in `new`; the executor synchronizes after every run.
        unsafe {
            for [a, b] in self.events.values() {
                let _ = sys::cuEventDestroy_v2(*a);
                let _ = sys::cuEventDestroy_v2(*b);
            }
            let _ = sys::cuStreamDestroy_v2(self.stream);
        }
    }
}

impl CudaExecutor {
    /// Makes this executor one rank of the data-parallel run of `env`: `all_reduce` launches
    /// go through NCCL (on one rank too, so that a one-rank run exercises the whole path;
    /// `timeout` bounds the rendezvous), beside the backward on a second stream when `overlap`
    /// (this module). Call it before the first run: CUDA graphs capture the collectives.
    pub fn join_ranks(&mut self, env: &LaunchEnv, timeout: Duration, overlap: bool) -> Result<(), String> {
        self.dev.bind()?;
        self.nccl = Some(NcclRank::join(env, timeout)?);
        if overlap {
            self.side = Some(SideStream::new(self.programs.iter().map(|(p, c)| (*p, c.launches.as_slice())))?);
        }
        if let Some(step) = self.programs.get(&Program::Step) {
            self.comm = Some(CommTiming::new(&step.launches)?);
        }
        Ok(())
    }

    /// Runs a collective step's parts on `stream`: through NCCL, or copies on one rank without a
    /// communicator.
    ///
    /// # Safety
    /// The parts' addresses were built against this allocation.
    pub(super) unsafe fn collective(&self, parts: &[(Addr, Addr, usize, DType, Option<usize>)], stream: sys::CUstream) -> Result<(), String> {
        let Some(nccl) = &self.nccl else {
            return parts.iter().filter(|p| p.0 != p.1).try_for_each(|&(src, dst, n, dt, _)| {
                ck(sys::cuMemcpyDtoDAsync_v2(self.addr(dst), self.addr(src), n * dt.size_bytes(), stream), "copy")
            });
        };
        nccl.collective(parts.iter().map(|&(s, t, n, dt, o)| (self.addr(s), self.addr(t), n, dt, o)), stream)
    }

    /// Runs launch `i` of `program`: first makes the step's stream wait for the side collectives
    /// it reads (removing them from `pending`), then runs it on the step's stream, or, when it is
    /// a side collective and `beside` allows, on the side stream (adding it to `pending`).
    ///
    /// # Safety
    /// The launch was built against this allocation; `pending` holds this run's side collectives.
    pub(super) unsafe fn launch(&self, program: Program, i: usize, l: &Launch, pending: &mut Vec<usize>, beside: bool) -> Result<(), String> {
        let main = self.dev.stream;
        let timing = self.comm.as_ref().filter(|_| program == Program::Step);
        if let Some(ev) = timing.and_then(|t| t.zero(i)) {
            comm_timing::record(ev, main)?;
        }
        let span = timing.and_then(|t| t.span(i));
        if let Some(side) = &self.side {
            if let Some(ev) = timing.and_then(|t| t.mark(i)).filter(|_| l.waits.iter().any(|j| pending.contains(j))) {
                comm_timing::record(ev, main)?;
            }
            for j in &l.waits {
                if let Some(at) = pending.iter().position(|p| p == j) {
                    pending.swap_remove(at);
                    ck(sys::cuStreamWaitEvent(main, side.events[&(program, *j)][1], 0), "stream wait")?;
                }
            }
            if let (true, Some(ev), Some(_), [Step::Collective { parts }]) =
                (beside && l.side, side.events.get(&(program, i)), &self.nccl, l.steps.as_slice())
            {
                ck(sys::cuEventRecord(ev[0], main), "event")?;
                ck(sys::cuStreamWaitEvent(side.stream, ev[0], 0), "stream wait")?;
                if let Some([started, _]) = span {
                    comm_timing::record(started, side.stream)?;
                }
                self.collective(parts, side.stream)?;
                if let Some([_, done]) = span {
                    comm_timing::record(done, side.stream)?;
                }
                ck(sys::cuEventRecord(ev[1], side.stream), "event")?;
                pending.push(i);
                return Ok(());
            }
        }
        if let Some([started, _]) = span {
            comm_timing::record(started, main)?;
        }
        for st in &l.steps {
            self.exec(st)?;
        }
        if let Some([_, done]) = span {
            comm_timing::record(done, main)?;
        }
        Ok(())
    }

    /// The mean over the ranks of host `values` (`owner` `None`), or rank `owner`'s `values`,
    /// through a buffer of its own (nothing of the plan is touched), on the step's stream;
    /// unchanged without a communicator.
    pub(super) fn host_collective(&self, values: &mut [f32], owner: Option<usize>) -> Result<(), String> {
        let Some(nccl) = &self.nccl else { return Ok(()) };
        self.dev.bind()?;
        let bytes = (4 * values.len()).max(4);
        // SAFETY: a fresh allocation of `bytes`, freed below after the stream is idle.
        unsafe {
            let buf = cudarc::driver::result::malloc_sync(bytes).map_err(|e| format!("CUDA allocation: {e:?}"))?;
            let r = self
                .dev
                .upload(buf, values)
                .and_then(|_| nccl.collective(std::iter::once((buf, buf, values.len(), DType::F32, owner)), self.dev.stream))
                .and_then(|_| self.dev.sync("collective of host values"))
                .and_then(|_| self.dev.download(values, buf));
            let _ = cudarc::driver::result::free_sync(buf);
            r
        }
    }

    /// Makes the step's stream wait for every side collective of this run still in `pending`.
    ///
    /// # Safety
    /// `pending` holds side collectives launched by [`CudaExecutor::launch`] in this run.
    pub(super) unsafe fn join_side(&self, program: Program, pending: &mut Vec<usize>) -> Result<(), String> {
        if let Some(side) = &self.side {
            let end = self.programs.get(&program).map_or(0, |c| c.launches.len());
            if let Some(ev) = self.comm.as_ref().filter(|_| program == Program::Step && !pending.is_empty()).and_then(|t| t.mark(end)) {
                comm_timing::record(ev, self.dev.stream)?;
            }
            for j in pending.drain(..) {
                ck(sys::cuStreamWaitEvent(self.dev.stream, side.events[&(program, j)][1], 0), "stream wait")?;
            }
        }
        Ok(())
    }
}
