use crate::{BoxError, Dependency, Verdict};
use std::fmt;
use tokio::time::Instant;

/// Asked before every attempt the retry layer makes, and told how it ended: a circuit breaker
/// (`backstop_breaker::Breaker` implements it), or any other admission rule.
///
/// Putting the breaker *inside* the retry loop this way, rather than as a separate layer
/// further in, gives the same behaviour (every attempt is admitted or refused on its own, and
/// a refusal stops the call with an honest error instead of being retried) without a second
/// future, a second classification of the same response, or a per-call request extension to
/// tell that layer which dependency the call is for.
///
/// A refusal is returned to the caller as it is (it should say when to try again); the attempt
/// is not made, so its outcome is "not sent", and the call stops.
pub trait AttemptGate: Send + Sync + fmt::Debug {
    /// Before an attempt to `dependency`: a ticket to make it, or the error to stop with.
    fn admit(&self, dependency: &Dependency) -> Result<Ticket, BoxError>;

    /// The attempt `ticket` admitted has ended: with `verdict`, or, for `None`, cancelled (the
    /// caller dropped the call) before it did. `started` is when the attempt started; a gate
    /// that needs the time it ended reads the clock itself.
    fn complete(
        &self,
        dependency: &Dependency,
        ticket: Ticket,
        verdict: Option<Verdict>,
        started: Instant,
    );
}

/// What an [`AttemptGate`] hands out to admit one attempt and gets back when it ends: 64 bits
/// of the gate's own (a breaker keeps the circuit's generation and the kind of call there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket(u64);

impl Ticket {
    /// A ticket carrying `bits`.
    pub const fn new(bits: u64) -> Self {
        Ticket(bits)
    }

    /// The bits it carries.
    pub const fn bits(self) -> u64 {
        self.0
    }
}
