//! One allocation shared by the three programs of a run: the Step program's persistent regions
//! (params, grads, Adam m and v, inputs) come first, then one transient arena as large as the
//! largest program's. Values of the Eval and Grad programs find their persistent buffers by
//! name, so every program sees the same parameters and gradients in place.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;

use fusec_ir::{Graph, Op, ValueId};
use fusec_passes::memplan::{MemPlan, Region, ALIGN};

/// The one allocation, 256-byte aligned and zeroed. It is requested with a small alignment (so
/// the system allocator hands out lazily zeroed pages instead of writing gigabytes of zeros up
/// front) and the base is rounded up to 256 bytes inside it.
pub struct Arena {
    raw: *mut u8,
    layout: Layout,
    base: *mut u8,
    size: usize,
}

// SAFETY: the arena is plain memory; the executor serializes access per launch.
unsafe impl Send for Arena {}

impl Arena {
    /// Allocates `bytes` (at least one byte).
    pub fn new(bytes: u64) -> Result<Arena, String> {
        let size = usize::try_from(bytes.max(1)).map_err(|_| format!("arena of {bytes} bytes does not fit in memory"))?;
        let layout = Layout::from_size_align(size + ALIGN as usize, 16).map_err(|e| e.to_string())?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        if raw.is_null() {
            return Err(format!("could not allocate the {:.1} MiB arena", bytes as f64 / 1048576.0));
        }
        // SAFETY: the padding of ALIGN bytes keeps the rounded base and `size` bytes inside.
        let base = unsafe { raw.add(raw.align_offset(ALIGN as usize)) };
        Ok(Arena { raw, layout, base, size })
    }
    /// The base address (256-byte aligned).
    pub fn base(&self) -> *mut u8 {
        self.base
    }
    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.raw, self.layout) }
    }
}

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
