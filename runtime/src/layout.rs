//! One address space shared by the programs of a run: the Step program's persistent regions
//! (params, grads, Adam m and v, inputs) come first, then one transient arena as large as the
//! largest program's. Values of the Eval and Grad programs find their persistent buffers by
//! name, so every program sees the same parameters and gradients in place. A run without a
//! Step program (the decoder's) starts from its first program's, and tensors only another
//! program has follow. Both targets lay out their one allocation (host or device) this way.

use std::collections::HashMap;

use fusec_ir::{Graph, Op, ValueId};
use fusec_passes::memplan::{MemPlan, Region, ALIGN};

/// Where persistent tensors live, by name: (byte offset, bytes).
pub struct SharedLayout {
    /// Offset and size of each parameter and input of the Step program.
    pub named: HashMap<String, (u64, u64)>,
    /// The Step program's persistent prefix: where the arena starts.
    pub persistent_bytes: u64,
    /// The gradient region (offset, bytes): zeroing it is one memset.
    pub grads: (u64, u64),
}

impl SharedLayout {
    /// The layout of the Step program's plan.
    pub fn new(step: &Graph, plan: &MemPlan) -> SharedLayout {
        let mut named = HashMap::new();
        for n in &step.nodes {
            if let Op::Param { name, .. } | Op::Input { name, .. } = &n.op {
                let vp = &plan.values[n.results[0].0 as usize];
                named.insert(name.clone(), (vp.offset, vp.bytes));
            }
        }
        let grads = plan.region(Region::Grads).map(|r| (r.offset, r.bytes)).unwrap_or((0, 0));
        SharedLayout { named, persistent_bytes: plan.persistent_bytes, grads }
    }

    /// Places the parameters and inputs of another program that this layout lacks after its
    /// persistent tensors ([`ALIGN`]ed), moving the arena's start; a name it has must fit in its
    /// place (the decoder's prefill and step programs share parameters, caches and `pos`, and
    /// each has its own token input).
    pub fn add_missing(&mut self, g: &Graph, plan: &MemPlan) -> Result<(), String> {
        for n in &g.nodes {
            let (Op::Param { name, .. } | Op::Input { name, .. }) = &n.op else { continue };
            let bytes = plan.values[n.results[0].0 as usize].bytes;
            match self.named.get(name) {
                Some(&(_, have)) if have < bytes => {
                    return Err(format!("`{name}` takes {bytes} bytes here but {have} in the shared layout"));
                }
                Some(_) => {}
                None => {
                    let at = self.persistent_bytes.checked_next_multiple_of(ALIGN).ok_or("the shared layout overflows 64 bits")?;
                    let end = at.checked_add(bytes).ok_or("the shared layout overflows 64 bits")?;
                    self.persistent_bytes = end.checked_next_multiple_of(ALIGN).ok_or("the shared layout overflows 64 bits")?;
                    self.named.insert(name.clone(), (at, bytes));
                }
            }
        }
        Ok(())
    }

    /// The byte offset in the shared allocation of value `v` of a program with plan `plan`.
    pub fn offset(&self, g: &Graph, plan: &MemPlan, v: ValueId) -> Result<u64, String> {
        let vp = &plan.values[v.0 as usize];
        if vp.region == Region::Arena {
            return Ok(self.persistent_bytes + (vp.offset - plan.persistent_bytes));
        }
        let mut root = v;
        while let Some((owner, _)) = plan.values[root.0 as usize].alias {
            root = owner;
        }
        let name = match &g.producer(root).op {
            Op::Param { name, .. } | Op::Input { name, .. } => name,
            other => return Err(format!("persistent value rooted at a `{}`, not a parameter or input", other.mnemonic())),
        };
        let (base, _) = self.named.get(name).ok_or_else(|| format!("`{name}` has no place in the training step's layout"))?;
        Ok(base + (vp.offset - plan.values[root.0 as usize].offset))
    }
}
