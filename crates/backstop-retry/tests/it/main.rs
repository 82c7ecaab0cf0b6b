//! The retry layer's integration tests in one binary, a module per concern.

mod attempts;
mod policy;
mod retry;
