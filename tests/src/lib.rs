//! Cross-crate tests live in `tests/tests/`: snapshots, parity with llm.c, backend vs interpreter.
