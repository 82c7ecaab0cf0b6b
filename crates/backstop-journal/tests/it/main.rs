//! The journal's integration tests in one binary, a module per concern.

mod cost;
mod journal;
mod model;
mod typed;
mod worker;
