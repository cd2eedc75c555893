//! Data-parallel training (issue 15): pure plans and the start-up protocol, tested on the CPU,
//! and a first check of NCCL on this host's GPUs. The step does not all-reduce yet.
//!
//! - [`bucket`]: gradient buckets over one flat gradient buffer in backward production order,
//!   each with the producer that completes it (where its all-reduce can start);
//! - [`shard`]: ZeRO-1 shards of the flat parameter space for the optimizer state, with the
//!   bytes each rank holds;
//! - [`launch_env`]: torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//!   `MASTER_PORT`) parsed and checked, and the environments of N ranks on one host;
//! - [`rendezvous`]: rank 0 hands a 128-byte blob (the NCCL unique id) to every other rank over
//!   TCP, with deadlines everywhere, so that a missing or silent rank is named, never waited
//!   for forever;
//! - [`nccl`]: every visible GPU as one rank of this process, an all-reduce checked and timed
//!   (`fusec nccl-check`).

pub mod bucket;
pub mod launch_env;
pub mod nccl;
pub mod rendezvous;
pub mod shard;
pub mod star;

/// Alignment in bytes of every gradient slot, bucket and shard offset: the memory plan's
/// ([`fusec_passes::memplan::ALIGN`], 256 bytes), which is also more than any vectorized
/// access or NCCL needs.
pub const ALIGN: u64 = fusec_passes::memplan::ALIGN;

/// One trainable parameter as the plans see it: a name (for messages), its element count and
/// the size of one element in bytes (4 for fp32, 2 for bf16).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    /// The parameter's name, e.g. `h.3.attn.c_attn.w`.
    pub name: String,
    /// How many elements it has (> 0).
    pub elements: u64,
    /// Bytes per element: 1, 2, 4 or 8.
    pub dtype_bytes: u64,
}

impl ParamSpec {
    /// A parameter `name` of `elements` elements of `dtype_bytes` bytes each.
    pub fn new(name: impl Into<String>, elements: u64, dtype_bytes: u64) -> ParamSpec {
        ParamSpec { name: name.into(), elements, dtype_bytes }
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> u64 {
        self.elements * self.dtype_bytes
    }
}

/// Checks what both plans require of their parameter list: at least one parameter, unique
/// names, no empty parameter, element sizes of 1, 2, 4 or 8 bytes, and a total that fits in
/// `u64` bytes. `what` names the plan in messages.
pub(crate) fn check_params(params: &[ParamSpec], what: &str) -> Result<(), String> {
    if params.is_empty() {
        return Err(format!("{what}: no parameters (at least one is needed)"));
    }
    let mut seen = std::collections::HashSet::new();
    let mut total: u64 = 0;
    for (i, p) in params.iter().enumerate() {
        if !seen.insert(p.name.as_str()) {
            return Err(format!("{what}: parameter `{}` is listed twice (second time at index {i})", p.name));
        }
        if p.elements == 0 {
            return Err(format!("{what}: parameter `{}` has 0 elements", p.name));
        }
        if !matches!(p.dtype_bytes, 1 | 2 | 4 | 8) {
            return Err(format!("{what}: parameter `{}` has {} bytes per element (allowed: 1, 2, 4, 8)", p.name, p.dtype_bytes));
        }
        total = p
            .elements
            .checked_mul(p.dtype_bytes)
            .and_then(|b| total.checked_add(align_up(b)?))
            .ok_or_else(|| format!("{what}: parameters too large (byte count overflows at `{}`)", p.name))?;
    }
    Ok(())
}

/// `n` rounded up to a multiple of [`ALIGN`] (`None` on overflow).
pub(crate) fn align_up(n: u64) -> Option<u64> {
    Some(n.checked_add(ALIGN - 1)? / ALIGN * ALIGN)
}

/// `n` with thousands separators (`124,475,904`), for the tables.
pub(crate) fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_name_the_parameter() {
        assert!(check_params(&[], "plan").unwrap_err().contains("no parameters"));
        let dup = [ParamSpec::new("a", 1, 4), ParamSpec::new("a", 2, 4)];
        assert!(check_params(&dup, "plan").unwrap_err().contains("`a` is listed twice"));
        let empty = [ParamSpec::new("w", 0, 4)];
        assert!(check_params(&empty, "plan").unwrap_err().contains("`w` has 0 elements"));
        let odd = [ParamSpec::new("w", 3, 3)];
        assert!(check_params(&odd, "plan").unwrap_err().contains("allowed: 1, 2, 4, 8"));
        let huge = [ParamSpec::new("w", u64::MAX / 2, 4)];
        assert!(check_params(&huge, "plan").unwrap_err().contains("overflows at `w`"));
    }

    #[test]
    fn helpers() {
        assert_eq!(align_up(0), Some(0));
        assert_eq!(align_up(1), Some(256));
        assert_eq!(align_up(256), Some(256));
        assert_eq!(align_up(u64::MAX), None);
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1000), "1,000");
        assert_eq!(grouped(124475904), "124,475,904");
    }
}
