//! Random well-typed graphs for property tests.
