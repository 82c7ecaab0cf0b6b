//! tmp
#![forbid(unsafe_code)]
