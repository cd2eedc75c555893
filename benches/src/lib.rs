//! Benchmarks: training step, compile time and memory, printing ratios against a peer measured in the same run.
