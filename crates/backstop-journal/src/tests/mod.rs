//! The journal against real databases, through the worker's claim protocol as well as the
//! public API: a module per concern.

mod journal;
mod model;
mod worker;
