//! Facts about this process's host memory (Linux `/proc`; `None` elsewhere).

/// The peak resident set size of this process in bytes (`VmHWM` of `/proc/self/status`).
pub fn peak_rss_bytes() -> Option<u64> {
    status_kib("VmHWM:").map(|k| k * 1024)
}

/// The current resident set size of this process in bytes (`VmRSS`).
pub fn rss_bytes() -> Option<u64> {
    status_kib("VmRSS:").map(|k| k * 1024)
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
}
