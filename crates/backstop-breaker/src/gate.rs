//! The breaker as the retry layer's [`AttemptGate`]: every attempt admitted or refused on its
//! own, inside the retry loop.

use crate::{
    Breaker,
    circuit::{Circuit, Kind, Signal},
    layer::signal,
};
use backstop_core::{AttemptGate, Ticket, Verdict};
use backstop_core::{BoxError, Dependency};
use std::{fmt, sync::Arc};
use tokio::time::Instant;

fn ticket(kind: Kind, generation: u64) -> Ticket {
    Ticket::new(generation << 1 | u64::from(kind == Kind::Trial))
}

fn unpack(ticket: Ticket) -> (Kind, u64) {
    let bits = ticket.bits();
    let kind = if bits & 1 == 1 {
        Kind::Trial
    } else {
        Kind::Normal
    };
    (kind, bits >> 1)
}

impl Breaker {
    #[inline]
    fn admit_through(
        &self,
        circuit: &Circuit,
        dependency: &Dependency,
    ) -> Result<Ticket, BoxError> {
        match self.inner.admit(circuit, dependency) {
            Ok((kind, generation)) => Ok(ticket(kind, generation)),
            Err(open) => {
                crate::permit::count_rejection(&open);
                Err(Box::new(open))
            }
        }
    }

    #[inline]
    fn complete_through(
        &self,
        circuit: &Circuit,
        ticket: Ticket,
        verdict: Option<Verdict>,
        started: Instant,
    ) {
        let (kind, generation) = unpack(ticket);
        let (signal, now) = match verdict.map(signal) {
            None => (Signal::Ignore, started),
            Some(Signal::Success) => match self.inner.config.slow_call {
                Some(limit) => {
                    let now = Instant::now();
                    if now.saturating_duration_since(started) > limit {
                        (Signal::Failure, now)
                    } else {
                        (Signal::Success, now)
                    }
                }
                // The start of the attempt dates the success: no second clock read.
                None => (Signal::Success, started),
            },
            Some(s) => (s, Instant::now()),
        };
        self.inner.record(circuit, kind, generation, signal, now);
    }

    /// This breaker's circuit for one dependency, looked up once: a stack whose dependency is
    /// fixed admits and records its attempts through it without a registry lookup per attempt.
    /// An attempt for another dependency still goes to that one's circuit.
    pub fn bind(&self, dependency: &Dependency) -> DependencyBreaker {
        DependencyBreaker {
            circuit: self.inner.circuits.get(dependency),
            dependency: dependency.clone(),
            breaker: self.clone(),
        }
    }
}

/// The breaker asks each dependency's circuit; see [`AttemptGate`].
impl AttemptGate for Breaker {
    fn admit(&self, dependency: &Dependency) -> Result<Ticket, BoxError> {
        self.admit_through(&self.inner.circuits.get(dependency), dependency)
    }

    fn complete(
        &self,
        dependency: &Dependency,
        ticket: Ticket,
        verdict: Option<Verdict>,
        started: Instant,
    ) {
        self.complete_through(
            &self.inner.circuits.get(dependency),
            ticket,
            verdict,
            started,
        );
    }
}

/// A [`Breaker`]'s circuit for one dependency, from [`Breaker::bind`].
#[derive(Clone)]
pub struct DependencyBreaker {
    circuit: Arc<Circuit>,
    dependency: Dependency,
    breaker: Breaker,
}

impl fmt::Debug for DependencyBreaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DependencyBreaker")
            .field("dependency", &self.dependency)
            .field("breaker", &self.breaker)
            .finish()
    }
}

impl DependencyBreaker {
    /// The breaker.
    pub fn breaker(&self) -> &Breaker {
        &self.breaker
    }
}

impl AttemptGate for DependencyBreaker {
    fn admit(&self, dependency: &Dependency) -> Result<Ticket, BoxError> {
        if *dependency == self.dependency {
            self.breaker.admit_through(&self.circuit, dependency)
        } else {
            self.breaker.admit(dependency)
        }
    }

    fn complete(
        &self,
        dependency: &Dependency,
        ticket: Ticket,
        verdict: Option<Verdict>,
        started: Instant,
    ) {
        if *dependency == self.dependency {
            self.breaker
                .complete_through(&self.circuit, ticket, verdict, started);
        } else {
            self.breaker.complete(dependency, ticket, verdict, started);
        }
    }
}
