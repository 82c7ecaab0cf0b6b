//! What must hold after every simulated run, checked against what happened (the ledger, the
//! attempts the leaf client saw, the budget's own counts), never against what the stack says
//! of itself alone.

use super::{CallRecord, Config, End, Report, World};
use backstop::Outcome;
use std::{fmt, time::Duration};

/// The simulation advances in steps of a millisecond: a timer set for the deadline fires at
/// the first step past it.
const TICK: Duration = Duration::from_millis(1);

/// A broken guarantee, with the call or the refund it is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Violation {
    /// A refund took effect more than once.
    DuplicateEffect {
        /// The refund.
        action: String,
        /// How many times.
        effects: u32,
    },
    /// A call ended after its deadline.
    PastDeadline {
        /// The call.
        call: String,
        /// When it ended.
        elapsed: Duration,
    },
    /// More attempts beyond the first than the budget allows (its ratio of the calls).
    OverBudget {
        /// Attempts beyond the first, all calls together.
        extra: u64,
        /// Logical calls.
        calls: u64,
    },
    /// More attempts beyond the first than retries and hedges the budget granted.
    Unpaid {
        /// Attempts beyond the first, all calls together.
        extra: u64,
        /// Retries and hedges the budget granted.
        granted: u64,
    },
    /// A call made more attempts than one retry layer makes (nested stacks multiplied).
    Multiplied {
        /// The call.
        call: String,
        /// Its attempts at the leaf.
        attempts: u32,
    },
    /// A refund answered with success whose effect did not happen.
    AnsweredWithoutEffect {
        /// The call.
        call: String,
    },
    /// A refund whose error says it did not take effect, but it did.
    NotSentButHappened {
        /// The call.
        call: String,
    },
    /// An error whose words say something else than its outcome.
    WordsDisagree {
        /// The call.
        call: String,
        /// Its message.
        message: String,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

/// The words an error must use for its outcome (what a model reads).
fn words(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::NotSent => "did not take effect",
        Outcome::Unknown => "may or may not have taken effect",
        Outcome::Completed => "answered",
    }
}

fn check_call(c: &CallRecord, config: &Config, effects: u32, attempts: u32) -> Vec<Violation> {
    let mut v = Vec::new();
    let call = || c.id.clone();
    if c.elapsed > config.deadline + TICK {
        v.push(Violation::PastDeadline {
            call: call(),
            elapsed: c.elapsed,
        });
    }
    // One retry layer's attempts: at most three for a refund, however many stacks it crosses;
    // a read's attempts may each be hedged once.
    let most = if c.action.is_some() { 3 } else { 6 };
    if attempts > most {
        v.push(Violation::Multiplied {
            call: call(),
            attempts,
        });
    }
    if let End::Failed {
        outcome, message, ..
    } = &c.end
        && !message.contains(words(*outcome))
    {
        v.push(Violation::WordsDisagree {
            call: call(),
            message: message.clone(),
        });
    }
    if c.action.is_none() {
        return v;
    }
    match &c.end {
        End::Answered(s) if *s < 300 && effects == 0 => {
            v.push(Violation::AnsweredWithoutEffect { call: call() })
        }
        End::Failed {
            outcome: Outcome::NotSent,
            ..
        } if effects > 0 => v.push(Violation::NotSentButHappened { call: call() }),
        _ => {}
    }
    v
}

/// The run's report, with every guarantee it broke.
pub(crate) fn report(
    seed: u64,
    config: &Config,
    world: &World,
    faults: Vec<(Duration, String)>,
) -> Report {
    let calls = world.calls.lock().unwrap().clone();
    let effects = world.ledger.lock().unwrap().clone();
    let attempts = world.attempts.lock().unwrap().clone();
    let budget = *world.budget.lock().unwrap();
    let mut violations: Vec<Violation> = effects
        .iter()
        .filter(|&(_, &n)| n > 1)
        .map(|(action, &effects)| Violation::DuplicateEffect {
            action: action.clone(),
            effects,
        })
        .collect();
    for c in &calls {
        let done = c
            .action
            .as_ref()
            .map_or(0, |a| *effects.get(a).unwrap_or(&0));
        let sent = *attempts.get(&c.id).unwrap_or(&0);
        violations.extend(check_call(c, config, done, sent));
    }
    let mut report = Report {
        seed,
        calls,
        effects,
        attempts,
        faults,
        budget,
        violations,
    };
    let n = report.calls.len() as u64;
    let extra = report.extra_attempts();
    // The ratio of the calls, and the one the budget may grant as its allowance first reaches it.
    if extra as f64 > config.budget_ratio * n as f64 + 1.0 {
        report
            .violations
            .push(Violation::OverBudget { extra, calls: n });
    }
    // Every attempt beyond a call's first was paid from the budget: none made around it.
    if extra > report.budget.1 {
        report.violations.push(Violation::Unpaid {
            extra,
            granted: report.budget.1,
        });
    }
    report
}
