//! [`CudaExecutor`] as an [`Executor`]: tensors in and out of the device allocation (bf16
//! rounded on the way in), and a program run, replayed from its CUDA graph or launched one by
//! one between CUDA events when profiling.

use std::ffi::c_void;
use std::time::Duration;

use cudarc::driver::sys;
use fusec_ir::interp::{round_to, Tensor};
use fusec_ir::DType;

use super::device::ck;
use super::CudaExecutor;
use crate::executor::{CommTimes, Executor, StepOutputs};
use crate::profile::{Profile, Timed};
use crate::programs::Program;
use crate::roofline::Limits;

impl Executor for CudaExecutor {
    fn all_reduce_host(&mut self, values: &mut [f32]) -> Result<(), String> {
        self.host_collective(values, None)
    }

    fn from_owner_host(&mut self, values: &mut [f32], owner: usize) -> Result<(), String> {
        self.host_collective(values, Some(owner))
    }

    fn peak_device_bytes(&self) -> Option<u64> {
        Some(self.peak)
    }

    fn allocated_device_bytes(&self) -> Option<u64> {
        Some(self.dev.size)
    }

    fn set(&mut self, name: &str, t: Tensor) -> Result<(), String> {
        let (off, dt, n) = self.place(name)?;
        if t.data.len() != n {
            return Err(format!("`{name}` holds {n} elements, got {}", t.data.len()));
        }
        match dt {
            DType::I32 => self.dev.upload(self.dev.base + off, &t.data.iter().map(|&x| x as i32).collect::<Vec<_>>()),
            DType::F32 => self.dev.upload(self.dev.base + off, &t.to_f32()),
            DType::BF16 => {
                // Rounded to nearest even, then exact in f32: its top 16 bits.
                let bits: Vec<u16> = t.data.iter().map(|&x| ((round_to(DType::BF16, x) as f32).to_bits() >> 16) as u16).collect();
                self.dev.upload(self.dev.base + off, &bits)
            }
            d => Err(format!("`{name}`: {d} tensors cannot be set on the GPU yet")),
        }
    }

    fn get(&self, name: &str) -> Result<Tensor, String> {
        let (off, dt, _) = self.place(name)?;
        self.read(off, dt, self.types[name].1.clone())
    }

    fn set_f32(&mut self, name: &str, dtype: DType, _shape: &[usize], data: &[f32]) -> Result<(), String> {
        let (off, dt, n) = self.place(name)?;
        if data.len() != n || dt != dtype {
            return Err(format!("`{name}` holds {n} {dt} elements, got {} {dtype}", data.len()));
        }
        match dt {
            DType::F32 => self.dev.upload(self.dev.base + off, data),
            DType::BF16 => {
                // Rounded (nearest even) a slice at a time, on every core: no full-size host copy
                // (one thread took ~1 ns an element: 1.5 s for GPT-2 1.5B's weight copies).
                use rayon::prelude::*;
                const SLICE: usize = 1 << 22;
                let mut bits = vec![0u16; SLICE.min(n)];
                for (i, c) in data.chunks(SLICE).enumerate() {
                    let b = &mut bits[..c.len()];
                    b.par_chunks_mut(1 << 14).zip(c.par_chunks(1 << 14)).for_each(|(b, c)| {
                        b.iter_mut().zip(c).for_each(|(b, &x)| *b = (fusec_ir::interp::bf16_of_f32(x).to_bits() >> 16) as u16)
                    });
                    self.dev.upload(self.dev.base + off + (i * SLICE * 2) as u64, b)?;
                }
                Ok(())
            }
            d => Err(format!("`{name}`: {d} tensors cannot be set from f32 values")),
        }
    }

    fn set_copy(&mut self, name: &str, copy: &str, dtype: DType, shape: &[usize], data: &[f32]) -> Result<(), String> {
        let ((src, sdt, n), (dst, ddt, m)) = (self.place(name)?, self.place(copy)?);
        if (sdt, ddt) != (DType::F32, DType::BF16) || n != m {
            return self.set_f32(copy, dtype, shape, data);
        }
        let (mut out, mut inp, mut count) = (self.dev.base + dst, self.dev.base + src, n as i64);
        let mut params = [&mut out as *mut u64 as *mut c_void, &mut inp as *mut u64 as *mut c_void, &mut count as *mut i64 as *mut c_void];
        let blocks = u32::try_from(n.div_ceil(256)).map_err(|_| format!("`{copy}`: {n} elements"))?;
        // SAFETY: both tensors are inside the allocation, `n` elements each.
        unsafe { self.dev.launch(self.round_bf16, [blocks, 1, 1], [256, 1, 1], 0, &mut params) }
    }

    fn get_f32(&self, name: &str, out: &mut Vec<f32>) -> Result<(), String> {
        let (off, dt, n) = self.place(name)?;
        out.resize(n, 0.0);
        match dt {
            DType::F32 => self.dev.download(out, self.dev.base + off),
            DType::BF16 => {
                let mut v = vec![0u16; n];
                self.dev.download(&mut v, self.dev.base + off)?;
                out.iter_mut().zip(v).for_each(|(o, x)| *o = f32::from_bits((x as u32) << 16));
                Ok(())
            }
            d => Err(format!("`{name}` is {d}, not a float tensor")),
        }
    }

    fn set_zeros(&mut self, name: &str, _dtype: DType, _shape: Vec<usize>) -> Result<(), String> {
        let (off, bytes) = *self.layout.named.get(name).ok_or_else(|| format!("no tensor named `{name}`"))?;
        self.dev.zero(self.dev.base + off, bytes)
    }

    fn zero_grads(&mut self) -> Result<(), String> {
        let (off, bytes) = self.layout.grads;
        self.dev.zero(self.dev.base + off, bytes)
    }

    fn run(&mut self, program: Program) -> Result<StepOutputs, String> {
        self.dev.bind()?;
        // A timed run launches one by one between CUDA events. `--profile` launches every run
        // so (its warm-up as its timed runs); a trace alone only its step, the rest as usual.
        let timed = self.profile.as_mut().is_some_and(|p| p.begin(program));
        let every = self.profile.as_ref().is_some_and(|p| p.times_every_step());
        let direct = timed || every || self.sync_each || !self.use_graphs;
        if !direct {
            let exec = match self.graphs.get(&program) {
                Some(e) => *e,
                None => {
                    let e = self.capture(program)?;
                    self.graphs.insert(program, e);
                    e
                }
            };
            // SAFETY: a graph of this executor's launches.
            unsafe { ck(sys::cuGraphLaunch(exec, self.dev.stream), "CUDA graph launch")? };
        }
        let prog = self.programs.get(&program).ok_or_else(|| format!("program {program:?} was not compiled"))?;
        let mut pending = vec![];
        for (i, l) in prog.launches.iter().enumerate().filter(|_| direct) {
            let named = |e: String| format!("{} ({program:?} launch {i}): {e}", l.name);
            // SAFETY: events were created for at least this many launches; steps were built
            // against this allocation.
            unsafe {
                if timed {
                    ck(sys::cuEventRecord(self.events[i].0, self.dev.stream), "event").map_err(named)?;
                }
                self.launch(program, i, l, &mut pending, !timed && !self.sync_each).map_err(named)?;
                if timed {
                    ck(sys::cuEventRecord(self.events[i].1, self.dev.stream), "event").map_err(named)?;
                }
            }
            if self.sync_each {
                self.dev.sync("kernel").map_err(named)?;
            }
        }
        // SAFETY: `pending` holds this run's side collectives.
        unsafe { self.join_side(program, &mut pending)? };
        self.dev.sync(&format!("{program:?} program (set FUSEC_CUDA_SYNC=1 to find the failing launch)"))?;
        if let Some(t) = self.comm.as_mut().filter(|_| program == Program::Step) {
            t.measure(&prog.launches, self.side.is_some() && (!direct || (!timed && !self.sync_each)));
        }
        if let Some(mut p) = self.profile.take() {
            // Starts from the run's first event, which is the run's zero.
            let ms = |a: sys::CUevent, b: sys::CUevent| {
                // SAFETY: both events were recorded and the stream is idle.
                let ms = unsafe { cudarc::driver::result::event::elapsed(a, b) }.unwrap_or(0.0);
                Duration::from_secs_f64(ms.max(0.0) as f64 / 1e3)
            };
            for (i, l) in prog.launches.iter().enumerate().filter(|_| timed) {
                let (start, dur) = (ms(self.events[0].0, self.events[i].0), ms(self.events[i].0, self.events[i].1));
                p.record(Timed { name: &l.name, bytes: l.bytes, flops: l.flops, ops: &l.ops, start, dur, threads: &[] });
            }
            self.profile = Some(p);
            self.peak = self.peak.max(self.dev.used_bytes());
        }
        self.take_index_error()?;
        let mut out = StepOutputs::default();
        for (name, off, _) in &prog.io.scalars {
            let mut v = [0f32];
            self.dev.download(&mut v, self.dev.base + off)?;
            out.set(name, v[0] as f64);
        }
        Ok(out)
    }

    fn output(&self, program: Program, name: &str) -> Result<Tensor, String> {
        let prog = self.programs.get(&program).ok_or_else(|| format!("program {program:?} was not compiled"))?;
        let (off, dt, shape) = prog.io.outputs.get(name).ok_or_else(|| format!("{program:?} has no output `{name}`"))?;
        self.read(*off, *dt, shape.clone())
    }

    fn profile(&self) -> Option<Profile> {
        self.profile.clone()
    }

    fn comm_times(&self) -> Option<Result<CommTimes, String>> {
        self.comm.as_ref().map(|t| t.times())
    }

    fn roof_key(&self, operands: DType) -> Option<String> {
        let math = match operands {
            DType::F32 if self.tf32 => "tf32".to_string(),
            DType::F32 => "fp32".to_string(),
            d => d.to_string(),
        };
        Some(format!("cuda {} ({}) · {math} products", self.dev.name, self.dev.sm()))
    }

    fn measure_limits(&mut self, operands: DType) -> Result<Limits, String> {
        self.measure(operands)
    }
}
