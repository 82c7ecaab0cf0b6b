use crate::{Deadline, Dependency, HasExtensions};
use std::{
    error::Error,
    fmt,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
    time::Duration,
};

/// One agent run (a task of many tool calls): a deadline and a retry budget that every call of
/// the run shares, on top of each dependency's own.
///
/// [`attach`](Run::attach) it to each tool call's request. The call's deadline is then the
/// earlier of its own and what is left of the run's, and every retry the retry layer makes for
/// any call of the run is taken from the run's budget first: when a carrier is down, its calls
/// can spend the run's retries but never more, so the run's other tools keep what is left of
/// its time. A call the run's budget refuses ends with the retry layer's `RunBudgetExhausted`.
///
/// Retries are counted per dependency ([`spent_by`](Run::spent_by)), so the spend can be
/// attributed to the tool that made it; the retry layer also logs the run's id with every
/// retry.
///
/// ```
/// use backstop_core::{Deadline, Dependency, Run};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let run = Run::new("run-7f3a")
///     .deadline(Duration::from_secs(120)) // the whole task: 2 minutes
///     .retry_budget(4);                    // retries across all of its tool calls
///
/// let mut call = http::Request::new(());
/// Deadline::after(Duration::from_secs(300)).tighten(&mut call); // the call's own is later
/// run.attach(&mut call);
/// assert_eq!(Deadline::of(&call).unwrap().remaining(), Duration::from_secs(120));
///
/// let carrier = Dependency::new("carrier-api");
/// for _ in 0..4 {
///     assert!(Run::of(&call).unwrap().take_retry(&carrier));
/// }
/// assert!(!run.take_retry(&carrier), "the run's fifth retry is refused");
/// assert_eq!(run.spent_by(), vec![(carrier, 4)]);
/// # }
/// ```
#[derive(Clone)]
pub struct Run {
    id: Arc<str>,
    deadline: Option<Deadline>,
    budget: Option<u32>,
    ceiling: Option<u64>,
    spend: Arc<Spend>,
}

#[derive(Default)]
struct Spend {
    total: AtomicU32,
    by_dependency: Mutex<Vec<(Dependency, u32)>>,
    /// What its calls have cost, in the unit of the ceiling.
    cost: AtomicU64,
}

impl fmt::Debug for Run {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Run")
            .field("id", &self.id)
            .field("deadline", &self.deadline)
            .field("retry_budget", &self.budget)
            .field("retries_spent", &self.retries_spent())
            .finish()
    }
}

impl Run {
    /// A run with no deadline and no budget of its own (set them with
    /// [`deadline`](Run::deadline) and [`retry_budget`](Run::retry_budget)).
    pub fn new(id: impl Into<Arc<str>>) -> Self {
        Run {
            id: id.into(),
            deadline: None,
            budget: None,
            ceiling: None,
            spend: Arc::default(),
        }
    }

    /// The run's calls may cost at most `units` in all, in the unit their `Cost` counts
    /// (tokens, for an LLM API; see `backstop_quota::Cost`), every attempt counted: an attempt
    /// that would pass the ceiling is refused before it is sent ([`RunSpent`], outcome not
    /// sent), in the run's words. The stack's pacing layer (`Backstop::pace`) charges each
    /// attempt.
    ///
    /// ```
    /// use backstop_core::Run;
    ///
    /// let run = Run::new("run-7f3a").spend_ceiling(10_000);
    /// assert!(run.spend(6_000).is_ok());
    /// let refused = run.spend(6_000).unwrap_err();
    /// assert_eq!(run.spent(), 6_000, "a refused attempt costs nothing");
    /// assert_eq!(
    ///     refused.to_string(),
    ///     "run run-7f3a has spent 6000 of the 10000 it may spend and this call needs 6000 more, \
    ///      so it was not sent",
    /// );
    /// ```
    #[must_use]
    pub fn spend_ceiling(mut self, units: u64) -> Self {
        self.ceiling = Some(units);
        self
    }

    /// What the run's calls have cost so far, in the unit of its ceiling.
    pub fn spent(&self) -> u64 {
        self.spend.cost.load(Ordering::Acquire)
    }

    /// Charges `units` to the run, unless that would pass its ceiling (nothing is charged
    /// then). A run without a ceiling always says yes, and still counts.
    pub fn spend(&self, units: u64) -> Result<(), RunSpent> {
        let Some(ceiling) = self.ceiling else {
            self.spend.cost.fetch_add(units, Ordering::AcqRel);
            return Ok(());
        };
        self.spend
            .cost
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |spent| {
                spent.checked_add(units).filter(|after| *after <= ceiling)
            })
            .map(|_| ())
            .map_err(|spent| RunSpent {
                run: self.id.clone(),
                ceiling,
                spent,
                cost: units,
            })
    }

    /// The run must end within `length` from now: no call of the run is given longer than
    /// what is left of it.
    #[must_use]
    pub fn deadline(mut self, length: Duration) -> Self {
        self.deadline = Some(Deadline::after(length));
        self
    }

    /// The run may make at most `retries` retries in all, whichever calls make them (the first
    /// attempt of a call never counts).
    #[must_use]
    pub fn retry_budget(mut self, retries: u32) -> Self {
        self.budget = Some(retries);
        self
    }

    /// The run's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The run's retry budget, if it has one.
    pub fn budget(&self) -> Option<u32> {
        self.budget
    }

    /// Puts the run on a tool call's request: its deadline tightens the call's, and the retry
    /// layer takes the call's retries from its budget.
    pub fn attach<R: HasExtensions + ?Sized>(&self, req: &mut R) {
        if let Some(deadline) = self.deadline {
            deadline.tighten(req);
        }
        req.extensions_mut().insert(self.clone());
    }

    /// The run a request belongs to, if one was attached.
    pub fn of<R: HasExtensions + ?Sized>(req: &R) -> Option<&Run> {
        req.extensions().get::<Run>()
    }

    /// Takes one retry for a call to `dependency` from the run's budget; `false` when it is
    /// spent (nothing is taken). A run without a budget always says yes, and still counts.
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
    pub fn take_retry(&self, dependency: &Dependency) -> bool {
        let taken = self
            .spend
            .total
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| match self.budget {
                Some(max) if n >= max => None,
                _ => Some(n.saturating_add(1)),
            })
            .is_ok();
        if taken {
            let mut by = self
                .spend
                .by_dependency
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            match by.iter_mut().find(|(d, _)| d == dependency) {
                Some((_, n)) => *n += 1,
                None => by.push((dependency.clone(), 1)),
            }
        }
        taken
    }

    /// Gives back a retry [`take_retry`](Run::take_retry) took, when the retry was not made
    /// after all (the dependency's own budget refused it).
    #[doc(hidden)] // How Backstop's layers reach each other; not for users.
    pub fn give_back(&self, dependency: &Dependency) {
        let mut by = self
            .spend
            .by_dependency
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(i) = by.iter().position(|(d, _)| d == dependency) {
            by[i].1 -= 1;
            if by[i].1 == 0 {
                by.remove(i);
            }
            self.spend.total.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Retries the run's calls have made.
    pub fn retries_spent(&self) -> u32 {
        self.spend.total.load(Ordering::Acquire)
    }

    /// Retries the run's budget still allows (`None`: no budget).
    pub fn retries_left(&self) -> Option<u32> {
        self.budget
            .map(|max| max.saturating_sub(self.retries_spent()))
    }

    /// The run's retries per dependency, in the order the dependencies first retried.
    pub fn spent_by(&self) -> Vec<(Dependency, u32)> {
        self.spend
            .by_dependency
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// A per-request cap on attempts, below the retry layer's own: a request that carries
/// `AttemptLimit(1)` is sent once and never repeated automatically (a destructive tool), whatever
/// the layer's `max_attempts`.
///
/// ```
/// use backstop_core::{AttemptLimit, HasExtensions};
///
/// let mut req = http::Request::new(());
/// req.extensions_mut().insert(AttemptLimit(1));
/// assert_eq!(AttemptLimit::of(&req), Some(1));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttemptLimit(pub u32);

impl AttemptLimit {
    /// The cap a request carries, if any.
    pub fn of<R: HasExtensions + ?Sized>(req: &R) -> Option<u32> {
        req.extensions().get::<AttemptLimit>().map(|l| l.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_retry_takes_nothing_and_a_given_back_one_returns() {
        let run = Run::new("r").retry_budget(1);
        let a = Dependency::new("a");
        let b = Dependency::new("b");
        assert!(run.take_retry(&a));
        assert!(!run.take_retry(&b));
        assert_eq!(run.spent_by(), vec![(a.clone(), 1)]);
        run.give_back(&a);
        assert_eq!(run.retries_left(), Some(1));
        assert!(run.spent_by().is_empty());
        assert!(run.take_retry(&b));
        // Giving back what was never taken changes nothing.
        run.give_back(&a);
        assert_eq!(run.retries_spent(), 1);
    }

    #[test]
    fn clones_share_one_spend() {
        let run = Run::new("r").retry_budget(2);
        let other = run.clone();
        let d = Dependency::new("d");
        assert!(run.take_retry(&d) && other.take_retry(&d));
        assert!(!run.take_retry(&d));
        assert_eq!(other.retries_spent(), 2);
    }
}

/// An attempt was not sent: it would take its run past the run's spend ceiling
/// ([`Run::spend_ceiling`]). The side effect is [`Outcome::NotSent`](crate::Outcome::NotSent),
/// and repeating the call in this run will not help.
#[derive(Clone, Debug)]
pub struct RunSpent {
    run: Arc<str>,
    ceiling: u64,
    spent: u64,
    cost: u64,
}

impl RunSpent {
    /// The run's id.
    pub fn run(&self) -> &str {
        &self.run
    }
}

impl fmt::Display for RunSpent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "run {} has spent {} of the {} it may spend and this call needs {} more, so it was \
             not sent",
            self.run, self.spent, self.ceiling, self.cost
        )
    }
}

impl Error for RunSpent {}
