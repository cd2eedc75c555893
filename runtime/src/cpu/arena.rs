//! The CPU target's one host allocation, laid out as [`crate::layout::SharedLayout`] says.

use std::alloc::{alloc_zeroed, dealloc, Layout};

use fusec_passes::memplan::ALIGN;

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

/// Host memory available to a new allocation (`MemAvailable` of `/proc/meminfo`), where known.
pub fn host_available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.raw, self.layout) }
    }
}
