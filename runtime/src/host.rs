//! Facts about this process's host memory (Linux `/proc`; `None` elsewhere).

/// The peak resident set size of this process in bytes (`VmHWM` of `/proc/self/status`).
pub fn peak_rss_bytes() -> Option<u64> {
    status_kib("VmHWM:").map(|k| k * 1024)
}

/// The current resident set size of this process in bytes (`VmRSS`).
pub fn rss_bytes() -> Option<u64> {
    status_kib("VmRSS:").map(|k| k * 1024)
}

/// The current resident bytes of this process by kind: anonymous memory (its own allocations)
/// and mapped files (shared libraries' code and data: libcublasLt alone maps 0.5 GB), from
/// `RssAnon` and `RssFile`.
pub fn rss_split_bytes() -> Option<(u64, u64)> {
    Some((status_kib("RssAnon:")? * 1024, status_kib("RssFile:")? * 1024))
}

fn status_kib(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines().find(|l| l.starts_with(key))?.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn peak_is_at_least_the_current_size() {
        // The current size first: other test threads may grow the process in between.
        let now = super::rss_bytes();
        if let (Some(peak), Some(now)) = (super::peak_rss_bytes(), now) {
            assert!(peak >= now && now > 0, "{peak} {now}");
        }
    }

    #[test]
    fn anonymous_memory_grows_with_a_touched_allocation() {
        let Some((before, _)) = super::rss_split_bytes() else { return };
        let v = std::hint::black_box(vec![1u8; 64 << 20]);
        let (after, file) = super::rss_split_bytes().unwrap();
        // It grew by the 64 MiB touched here, less what other test threads freed meanwhile
        // (allowed: up to 32 MiB).
        assert!(after + (32 << 20) >= before + (64 << 20) && file > 0, "{before} {after} {file}");
        drop(v);
    }
}
