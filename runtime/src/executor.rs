//! The interface every target implements for the training loop, and the interpreter's version.

use std::collections::HashMap;

use fusec_ir::interp::{self, Rounding, Tensor};
use fusec_ir::{Bindings, DType, Graph};

use crate::profile::Profile;
use crate::programs::{Program, RunPrograms};
use crate::roofline::Limits;

/// A target that holds named tensors (parameters, optimizer state, gradient accumulators,
/// per-step inputs) and runs programs over them.
pub trait Executor {
    /// Sets a named tensor.
    fn set(&mut self, name: &str, t: Tensor) -> Result<(), String>;
    /// Reads a named tensor back.
    fn get(&self, name: &str) -> Result<Tensor, String>;
    /// Sets `copy` to the values of `name` (just set from `data`) rounded to `dtype`: the bf16
    /// copies of the weights. Executors that hold both on the device round there.
    fn set_copy(&mut self, name: &str, copy: &str, dtype: DType, shape: &[usize], data: &[f32]) -> Result<(), String> {
        let _ = name;
        self.set_f32(copy, dtype, shape, data)
    }
    /// Sets a named tensor to zeros (executors that hold device or arena memory override this to
    /// avoid building a host tensor).
    fn set_zeros(&mut self, name: &str, dtype: DType, shape: Vec<usize>) -> Result<(), String> {
        self.set(name, Tensor::zeros(dtype, shape))
    }
    /// Sets a float tensor (`dtype` F32 or BF16) from f32 values, rounded to `dtype` (bf16: to
    /// nearest even). Executors that hold arena or device memory override this to write the
    /// values in place, without an f64 host tensor.
    fn set_f32(&mut self, name: &str, dtype: DType, shape: &[usize], data: &[f32]) -> Result<(), String> {
        let data = data.iter().map(|&x| interp::round_to(dtype, x as f64)).collect();
        self.set(name, Tensor { dtype, shape: shape.to_vec(), data })
    }
    /// Reads a float tensor into `out` as f32 values (bf16 widens exactly), reusing its
    /// allocation. Executors that hold arena or device memory override this to copy the values
    /// without an f64 host tensor.
    fn get_f32(&self, name: &str, out: &mut Vec<f32>) -> Result<(), String> {
        let t = self.get(name)?;
        out.clear();
        out.extend(t.data.iter().map(|&x| x as f32));
        Ok(())
    }
    /// Sets every gradient accumulator to zero.
    fn zero_grads(&mut self) -> Result<(), String>;
    /// Runs a program. Outputs named like a held tensor are written back to it; the scalar
    /// outputs (`loss`, `grad_norm`) are returned.
    fn run(&mut self, program: Program) -> Result<StepOutputs, String>;
    /// The output `name` of the latest run of `program`.
    fn output(&self, program: Program, name: &str) -> Result<Tensor, String>;
    /// Replaces each of `values` by its mean over the ranks of a data-parallel run, through the
    /// executor's collective (unchanged on one rank): the run's figures that rank 0 reports for
    /// every rank. Every rank must call it, in the same order.
    fn all_reduce_host(&mut self, values: &mut [f32]) -> Result<(), String> {
        let _ = values;
        Ok(())
    }
    /// Replaces `values` by rank `owner`'s `values` (unchanged on one rank): gathers what one
    /// rank alone holds (ZeRO-1's AdamW moments, for a checkpoint). Every rank must call it, in
    /// the same order.
    fn from_owner_host(&mut self, values: &mut [f32], owner: usize) -> Result<(), String> {
        let _ = (values, owner);
        Ok(())
    }
    /// Where the training steps' collectives spent their time, for executors of a
    /// data-parallel run that time them (`Err`: why they could not be timed).
    fn comm_times(&self) -> Option<Result<CommTimes, String>> {
        None
    }
    /// Peak device memory in bytes, for GPU executors.
    fn peak_device_bytes(&self) -> Option<u64> {
        None
    }
    /// Device memory the executor allocated (its one allocation: the memory plan, scratch and
    /// the cuBLAS workspace), for GPU executors: what `torch.cuda.max_memory_allocated` counts.
    fn allocated_device_bytes(&self) -> Option<u64> {
        None
    }
    /// Per-kernel timings, for executors that profile.
    fn profile(&self) -> Option<Profile> {
        None
    }
    /// What the roofline limits of products of `operands` depend on (the device, and on the
    /// CPU the thread count and instruction-set level; the product type): their cache key, for
    /// executors that profile.
    fn roof_key(&self, operands: DType) -> Option<String> {
        let _ = operands;
        None
    }
    /// Measures the memory bandwidth and the rate of products of `operands` (bf16, or f32 in
    /// the run's math: TF32 where it uses it) for the profile's roofline column.
    fn measure_limits(&mut self, operands: DType) -> Result<Limits, String> {
        let _ = operands;
        Err("this target has no roofline".into())
    }
}

/// The training steps' collectives, summed over the steps measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommTimes {
    /// Steps measured.
    pub steps: u32,
    /// Milliseconds the collectives ran.
    pub busy_ms: f64,
    /// Milliseconds of those that the step waited for (the rest ran beside its kernels).
    pub exposed_ms: f64,
}

/// The scalar outputs of a program run (a fixed struct: reading them allocates nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepOutputs {
    /// The `loss` output.
    pub loss: Option<f64>,
    /// The `grad_norm` output (with gradient clipping).
    pub grad_norm: Option<f64>,
}

impl StepOutputs {
    /// Records the scalar output `name` (others are ignored).
    pub fn set(&mut self, name: &str, v: f64) {
        match name {
            "loss" => self.loss = Some(v),
            "grad_norm" => self.grad_norm = Some(v),
            _ => {}
        }
    }
}

/// Runs the three programs through the reference interpreter.
pub struct RefExecutor {
    graphs: HashMap<Program, Graph>,
    bindings: Bindings,
    rounding: Rounding,
    tensors: HashMap<String, Tensor>,
    last: HashMap<(Program, String), Tensor>,
}

impl RefExecutor {
    /// An executor for the programs of a run, rounding as `rounding` says.
    pub fn new(run: &RunPrograms, rounding: Rounding) -> RefExecutor {
        let (graphs, bindings) = (run.graphs.clone(), run.bind.clone());
        RefExecutor { graphs, bindings, rounding, tensors: HashMap::new(), last: HashMap::new() }
    }
}

impl Executor for RefExecutor {
    fn set(&mut self, name: &str, t: Tensor) -> Result<(), String> {
        self.tensors.insert(name.to_string(), t);
        Ok(())
    }

    fn get(&self, name: &str) -> Result<Tensor, String> {
        self.tensors.get(name).cloned().ok_or_else(|| format!("no tensor named `{name}`"))
    }

    fn output(&self, program: Program, name: &str) -> Result<Tensor, String> {
        self.last.get(&(program, name.to_string())).cloned().ok_or_else(|| format!("{program:?} has produced no `{name}`"))
    }

    fn zero_grads(&mut self) -> Result<(), String> {
        for (name, t) in self.tensors.iter_mut() {
            if name.starts_with("grad.") {
                t.data.iter_mut().for_each(|x| *x = 0.0);
            }
        }
        Ok(())
    }

    fn run(&mut self, program: Program) -> Result<StepOutputs, String> {
        let g = self.graphs.get(&program).ok_or_else(|| format!("program {program:?} was not compiled"))?;
        let mut feeds = HashMap::new();
        for (name, _) in g.params().into_iter().chain(g.inputs()) {
            let t = self.tensors.get(name).ok_or_else(|| format!("nothing was set for `{name}`"))?;
            feeds.insert(name.to_string(), t.clone());
        }
        let outs = interp::run(g, &self.bindings, &feeds, self.rounding).map_err(|e| e.to_string())?;
        let mut scalars = StepOutputs::default();
        for ((name, _), t) in g.outputs.iter().zip(outs) {
            if t.shape.is_empty() {
                scalars.set(name, t.data[0]);
            }
            if self.tensors.contains_key(name) {
                self.tensors.insert(name.clone(), t);
            } else {
                self.last.insert((program, name.clone()), t);
            }
        }
        Ok(scalars)
    }
}
