//! Idempotency keys: one key per intended *action*, reused on every attempt.
//!
//! An idempotency key lets the server recognise a repeated request and return the original
//! result instead of acting twice. It only works if it identifies the action, not the attempt:
//! a new key per attempt defeats it entirely. This crate
//!
//! - defines [`IdempotencyKey`] (validated: 1 to 255 visible ASCII characters, no `"` or `\`,
//!   so it can never smuggle a second header line or break a structured-field string);
//! - derives keys deterministically, so the same action in the same run always gets the same key
//!   and a new action gets a new one: from the run id, step id and tool-call id
//!   ([`ActionContext::tool_call`]), or from the run id, tool name and canonical arguments
//!   ([`ActionContext::action`], and with the `json` feature [`ActionContext::action_json`],
//!   canonicalised per RFC 8785), each giving its [`key`](ActionContext::key);
//! - injects the key **once per logical call, before the retry loop** ([`IdempotencyLayer`]), as
//!   an `Idempotency-Key` header for HTTP or through [`KeyedRequest`] for other tool calls, and
//!   marks the request [`ReplaySafe`](backstop_core::ReplaySafe) so the retry layer may repeat
//!   it after a lost reply.
//!
//! ## The derivation, byte for byte
//!
//! So that another language can derive the same key: the key is the lowercase hexadecimal
//! SHA-256 (64 characters) of
//!
//! ```text
//! "backstop-idempotency-key/v1" 0x00  field(kind)  field(a)  field(b)  field(c)
//! field(x) = big-endian u32 length of x in bytes, then the bytes of x (UTF-8 for text)
//! kind     = "tool-call" with a, b, c = run id, step id, tool-call id
//!          | "action"    with a, b, c = run id, tool name, canonical arguments
//! ```
//!
//! Length prefixes make the layout unambiguous (`("ab", "c")` and `("a", "bc")` differ). Python:
//!
//! ```text
//! import hashlib, struct
//! f = lambda b: struct.pack(">I", len(b)) + b
//! m = b"backstop-idempotency-key/v1\x00" + f(b"tool-call") + f(b"run-91f2") + f(b"step-3") + f(b"call-07")
//! hashlib.sha256(m).hexdigest()  # 62c365e88817e25626ebbb4f2483d275b4594ce9369da9139952f99edd3dcfa8
//! ```
//!
//! ```
//! use backstop_idempotency::ActionContext;
//!
//! let key = ActionContext::tool_call("run-91f2", "step-3", "call-07").key();
//! assert_eq!(key.as_str(), "62c365e88817e25626ebbb4f2483d275b4594ce9369da9139952f99edd3dcfa8");
//! // The same action, retried or resumed, gets the same key; the next step gets another.
//! assert_eq!(key, ActionContext::tool_call("run-91f2", "step-3", "call-07").key());
//! assert_ne!(key, ActionContext::tool_call("run-91f2", "step-4", "call-08").key());
//! ```
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod key;
mod layer;

pub use key::{ActionContext, IdempotencyKey, InvalidKey, KeyFormat};
pub use layer::{
    HttpKeys, IdempotencyLayer, Inject, KeyedRequest, MakeKey, NoKey, RandomKey, SetIdempotencyKey,
    ToolKeys,
};

/// Future types.
pub mod future {
    pub use crate::layer::KeyFuture;
}

/// Not part of the public API: what the Backstop crates use to reach each other. Anything here
/// may change in any release.
#[doc(hidden)]
pub mod plumbing {
    pub use crate::layer::attach_key as attach;
}
