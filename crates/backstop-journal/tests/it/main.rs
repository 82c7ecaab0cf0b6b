//! The journal's integration tests in one binary, a module per concern: what a user of the
//! public API does. The tests of the worker's claim protocol, which is the crate's own, are
//! unit tests (`src/tests/`).

mod cost;
mod typed;
