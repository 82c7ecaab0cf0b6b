//! A run forked from a step: a new run of the same workflow and input whose steps before the
//! fork point hold the original's results (copied, with the keys their effects were made
//! with), so the workflow reads them without calling anything, and whose steps from the fork
//! point on run anew under the new run's keys. One transaction: the original's record locked,
//! the new run written with where it came from, the steps copied, an event on each run.

use crate::{
    JournalError, Operator, Runs,
    model::Step,
    run::{ForkPoint, RunRecord},
    store::Fork,
};

/// The steps of `run` recorded before the first call of `from_step`, each over; or why the fork
/// is refused: a step the run does not have is not found, as every missing run or step is.
pub(crate) fn copied_steps<'a>(
    steps: &'a [Step],
    run: &str,
    from_step: &str,
) -> Result<&'a [Step], JournalError> {
    let Some(at) = steps.iter().position(|s| *s.id.step == *from_step) else {
        let mut names: Vec<&str> = steps.iter().map(|s| &*s.id.step).collect();
        names.dedup();
        let recorded = if names.is_empty() {
            "it recorded no steps".to_owned()
        } else {
            format!("its steps are {}", names.join(", "))
        };
        return Err(JournalError::NotFound(format!(
            "step {from_step:?} of run {run} ({recorded})"
        )));
    };
    let before = &steps[..at];
    if let Some(open) = before.iter().find(|s| !s.state.is_final()) {
        return Err(JournalError::RunRefused {
            run: run.to_owned(),
            why: format!(
                "step {} before the fork point is {}: its outcome must be known first (resolve \
                 it, or fork from it)",
                open.id, open.state
            ),
        });
    }
    Ok(before)
}

impl Runs<'_> {
    /// The runs forked from run `run`, oldest first.
    pub async fn forks(self, run: &str) -> Result<Vec<RunRecord>, JournalError> {
        self.0.store.forks(run).await
    }
}

impl Operator<'_> {
    /// Forks run `run` at step `from_step` into a new pending run `new_run` of the same
    /// workflow and input, recorded with who and why on both runs; a [`Worker`] runs it.
    ///
    /// The steps recorded before `from_step` (in the order they were recorded) are copied with
    /// their state, result, provider reference and key: the workflow gets their results back
    /// and calls nothing for them. `from_step` and every step after it are not copied: they run
    /// anew, with keys derived from `new_run`, so their effects happen again (once each).
    /// The original keeps its steps and history; its events name the fork, and the new run's
    /// record names where it came from ([`RunRecord::forked_from`], [`Runs::forks`]).
    ///
    /// Refused, with the reason and nothing written, when `run` is still pending or waits for
    /// a person (it could still act: cancel it first), when it has no step `from_step`, when
    /// a step before the fork point is not over (its outcome must be known before the new
    /// run relies on it), and when `new_run` is another run already. Forking again with the
    /// same arguments returns the fork as it is, so an operator whose command was cut off may
    /// repeat it.
    ///
    /// The copied steps keep their arguments' digests: a workflow whose arguments name its own
    /// run id gets [`JournalError::ArgsChanged`] at the first copied step.
    ///
    /// [`Worker`]: crate::Worker
    pub async fn fork(
        self,
        run: &str,
        from_step: &str,
        new_run: &str,
        who: &str,
        why: &str,
    ) -> Result<RunRecord, JournalError> {
        let journal = self.0;
        let refused = |why: String| JournalError::RunRefused {
            run: run.to_owned(),
            why,
        };
        if let Some(existing) = journal.runs().get(new_run).await? {
            let same = ForkPoint {
                run: run.to_owned(),
                step: from_step.to_owned(),
            };
            return match existing.forked_from {
                Some(ref from) if *from == same => Ok(existing),
                _ => Err(JournalError::RunRefused {
                    run: new_run.to_owned(),
                    why: "a run of that id exists already: a fork needs an id of its own".into(),
                }),
            };
        }
        let now = journal.now_ms();
        let fork = Fork {
            run,
            from_step,
            new_run,
            who,
            why,
        };
        let forked = journal.store.fork(&fork, now).await?;
        if !forked {
            return Err(match journal.runs().get(run).await? {
                None => JournalError::NotFound(format!("run {run}")),
                Some(r) => refused(format!(
                    "it is {}: only a run that is over can be forked (cancel it first)",
                    r.state
                )),
            });
        }
        tracing::info!(target: "backstop::journal", run, from_step, new_run, who, why, "run forked");
        journal.existing_run(new_run).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{StepId, StepKind, StepState};

    fn step(name: &str, state: StepState) -> Step {
        Step {
            id: StepId::new("r", name, ""),
            tool: "t".into(),
            key: format!("k-{name}"),
            args_digest: "d".into(),
            kind: StepKind::Action,
            state,
            attempts: 1,
            last_error: None,
            result: None,
            provider_ref: None,
            parked_until: None,
            attention: None,
            created_at: chrono::DateTime::UNIX_EPOCH,
            updated_at: chrono::DateTime::UNIX_EPOCH,
            sent_at: None,
        }
    }

    #[test]
    fn the_steps_before_the_fork_point_are_copied_when_each_is_over() {
        let steps = [
            step("a", StepState::Succeeded),
            step("b", StepState::ReconciledSucceeded),
            step("c", StepState::FailedAfterExecution),
            step("d", StepState::Succeeded),
        ];
        let names = |s: &[Step]| s.iter().map(|s| s.id.step.to_string()).collect::<Vec<_>>();
        assert_eq!(names(copied_steps(&steps, "r", "c").unwrap()), ["a", "b"]);
        assert_eq!(
            names(copied_steps(&steps, "r", "a").unwrap()),
            Vec::<String>::new()
        );
        let missing = copied_steps(&steps, "r", "x").unwrap_err();
        assert!(matches!(missing, JournalError::NotFound(_)), "{missing:?}");
        assert!(
            (missing.to_string()).contains("step \"x\" of run r (its steps are a, b, c, d)"),
            "{missing}"
        );
    }

    #[test]
    fn a_step_in_doubt_before_the_fork_point_refuses_the_fork() {
        let steps = [
            step("a", StepState::Unknown),
            step("b", StepState::FailedAfterExecution),
        ];
        let why = copied_steps(&steps, "r", "b").unwrap_err().to_string();
        assert!(
            why.contains("step r/a before the fork point is unknown"),
            "{why}"
        );
        // From the step in doubt itself, nothing before it needs to be known.
        assert!(copied_steps(&steps, "r", "a").unwrap().is_empty());
    }
}
