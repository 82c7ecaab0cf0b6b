//! The replay layer's integration tests in one binary, a module per concern.

mod contract;
mod model;
mod postgres;
mod replay;
