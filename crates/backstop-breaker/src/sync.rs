//! The atomics the lock-free protocols use: std's here, loom's in the model checker
//! (`tests/loom.rs` includes the protocol files with its own `sync` module).

pub(crate) use std::sync::atomic::{AtomicU64, Ordering};
