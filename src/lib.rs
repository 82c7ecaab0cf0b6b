//! The unpublished package that owns Backstop's top-level `examples/` and `tests/`.
//! It has no code of its own; see the crates under `crates/`.
#![forbid(unsafe_code)]
