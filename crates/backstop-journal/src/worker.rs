//! The worker: recovery without a person. Workflows are registered by name; a worker claims
//! pending runs whose lease ran out (or that nobody claimed yet), keeps its lease while it runs
//! them, reconciles every step whose outcome is unknown, and runs the workflow again from the
//! top: steps that completed return their recorded results without a call, a parked step
//! defers the run until its durable timer is due, and the run's record says how it ended.

use crate::{
    JournalError,
    journal::Journal,
    reconcile::{Reconcilers, ResumeReport},
    run::{RunOutcome, RunRecord, RunState},
    workflow::{RunContext, RunEnd, RunError, RunReport, WorkflowFn, WorkflowResult},
};
use backstop_core::plumbing::CauseChain;
use std::{collections::HashMap, fmt, future::Future, sync::Arc, time::Duration};
use tokio::{sync::watch, time::Instant};

/// Runs the registered workflows' pending runs, and recovers every run whose worker died.
///
/// ```
/// use backstop_journal::{CallResult, Journal, RunState, Worker};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let journal = Journal::in_memory().await?;
/// let worker = Worker::new(journal.clone(), "worker-1").workflow("greet", |ctx| async move {
///     let sent = ctx
///         .step("say-hello", "mailer", b"{}", |_step| async {
///             CallResult::Succeeded { result: Some("\"msg_1\"".into()), provider_ref: None }
///         })
///         .await?;
///     Ok(sent.result)
/// });
/// journal.start_run("run-1", "greet", Some("{}")).await?;
/// worker.run_until_idle().await?;
/// let run = journal.runs().get("run-1").await?.unwrap();
/// assert_eq!(run.state, RunState::Succeeded);
/// assert_eq!(run.output.as_deref(), Some("\"msg_1\""));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Worker {
    journal: Journal,
    id: Arc<str>,
    workflows: HashMap<String, WorkflowFn>,
    reconcilers: Reconcilers,
    lease: Duration,
    poll: Duration,
    retry_delay: Duration,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("id", &self.id)
            .field("workflows", &self.names())
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

/// The shortest lease a worker takes: it renews every third of it.
const MIN_LEASE: Duration = Duration::from_millis(30);

impl Worker {
    /// A worker named `id` (unique among the workers sharing the journal) with no workflows
    /// yet: a 30 s lease renewed every 10 s, a look for runs every second, a 1 s wait before a
    /// step that was not sent is tried again.
    pub fn new(journal: Journal, id: &str) -> Self {
        Worker {
            journal,
            id: Arc::from(id),
            workflows: HashMap::new(),
            reconcilers: Reconcilers::new(),
            lease: Duration::from_secs(30),
            poll: Duration::from_secs(1),
            retry_delay: Duration::from_secs(1),
        }
    }

    /// Registers workflow `name`: an async function of its run's context, run again from the
    /// top whenever the run is recovered (steps that completed return their results without a
    /// call, so it must call the same steps with the same arguments each time).
    #[must_use]
    pub fn workflow<F, Fut>(mut self, name: &str, f: F) -> Self
    where
        F: Fn(RunContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = WorkflowResult> + Send + 'static,
    {
        self.workflows
            .insert(name.to_owned(), Arc::new(move |ctx| Box::pin(f(ctx))));
        self
    }

    /// The reconcile hooks asked about a step whose outcome is unknown before the run goes on.
    #[must_use]
    pub fn reconcilers(mut self, reconcilers: Reconcilers) -> Self {
        self.reconcilers = reconcilers;
        self
    }

    /// How long a claim lasts without renewal (renewed every third of it): a run whose
    /// worker died is free for another after this. At least 30 ms.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(MIN_LEASE);
        self
    }

    /// How often an idle worker looks for runs to claim (a parked run wakes within this of its
    /// time).
    #[must_use]
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll = every.max(Duration::from_millis(1));
        self
    }

    /// How long a run waits before a step that was not sent (or whose outcome is not known)
    /// is tried again.
    #[must_use]
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// The worker's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.workflows.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Claims one run it can run and runs it: `None` when none is free now.
    pub async fn run_once(&self) -> Result<Option<RunReport>, JournalError> {
        let (_keep, mut stop) = watch::channel(false);
        self.claim_and_drive(&mut stop).await
    }

    /// Runs runs until none is free now (a run deferred to later is not waited for): what a
    /// test, a demo or a cron job does.
    pub async fn run_until_idle(&self) -> Result<Vec<RunReport>, JournalError> {
        let (_keep, mut stop) = watch::channel(false);
        let mut reports = Vec::new();
        while let Some(report) = self.claim_and_drive(&mut stop).await? {
            reports.push(report);
        }
        Ok(reports)
    }

    /// Runs runs until `shutdown` completes, looking for new ones every poll interval. On
    /// shutdown the run in hand is stopped and its claim given back at once (its steps are
    /// where the journal has them: the next claim reconciles what was in flight).
    pub async fn run_until(&self, shutdown: impl Future<Output = ()>) -> Result<(), JournalError> {
        let (stop_tx, stop) = watch::channel(false);
        let work = self.work(stop);
        tokio::pin!(work);
        tokio::select! {
            done = &mut work => return done,
            () = shutdown => {}
        }
        let _ = stop_tx.send(true);
        work.await
    }

    async fn work(&self, mut stop: watch::Receiver<bool>) -> Result<(), JournalError> {
        while !*stop.borrow() {
            match self.claim_and_drive(&mut stop).await {
                Ok(Some(_)) => continue,
                Ok(None) => {}
                Err(e) => tracing::warn!(
                    target: "backstop::journal",
                    worker = %self.id,
                    error = %CauseChain(&e),
                    "claiming a run failed; trying again"
                ),
            }
            tokio::select! {
                () = tokio::time::sleep(self.poll) => {}
                Ok(()) = stop.changed() => {}
            }
        }
        Ok(())
    }

    async fn claim_and_drive(
        &self,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Option<RunReport>, JournalError> {
        let names = self.names();
        let Some(run) = self
            .journal
            .claim_next(&self.id, self.lease, &names)
            .await?
        else {
            return Ok(None);
        };
        Ok(Some(self.drive(&run, stop).await))
    }

    /// Runs claimed run `run` to its end for now, and says how it ended.
    async fn drive(&self, run: &str, stop: &mut watch::Receiver<bool>) -> RunReport {
        let mut report = RunReport {
            run: run.to_owned(),
            reconciled: ResumeReport::default(),
            end: RunEnd::Released { why: String::new() },
        };
        report.end = match self.prepare(run, &mut report.reconciled).await {
            Ok(Prepared::Run(record, workflow)) => self.run_workflow(*record, workflow, stop).await,
            Ok(Prepared::Ended(end)) => end,
            Err(e) => {
                self.give_back(run, format!("the journal failed: {}", CauseChain(&e)))
                    .await
            }
        };
        tracing::info!(
            target: "backstop::journal",
            worker = %self.id,
            run,
            end = ?report.end,
            "run handled"
        );
        report
    }

    /// Before the workflow runs again: its record, and every step whose outcome is unknown
    /// reconciled.
    async fn prepare(
        &self,
        run: &str,
        report: &mut ResumeReport,
    ) -> Result<Prepared, JournalError> {
        let record = self.journal.existing_run(run).await?;
        let Some(workflow) = record
            .workflow
            .as_deref()
            .and_then(|w| self.workflows.get(w))
            .cloned()
        else {
            let why = format!("worker {} has no workflow {:?}", self.id, record.workflow);
            return Ok(Prepared::Ended(self.give_back(run, why).await));
        };
        *report = match self.journal.reconcile_run(run, &self.reconcilers).await {
            Ok(report) => report,
            // A run killed before its first step has none to reconcile.
            Err(JournalError::NotFound(_)) => ResumeReport::default(),
            Err(e) => return Err(e),
        };
        if let Some(step) = report.human.first() {
            // The journal marked the run when it handed the step over; a step handed over
            // before this claim leaves it to be marked here.
            let why = format!("step {step} waits for a person");
            return Ok(Prepared::Ended(
                match self.journal.run_needs_human(run, &self.id, &why).await {
                    Ok(_) | Err(JournalError::RunRefused { .. }) => RunEnd::NeedsHuman { why },
                    Err(e) => {
                        self.give_back(run, format!("the journal failed: {}", CauseChain(&e)))
                            .await
                    }
                },
            ));
        }
        Ok(Prepared::Run(Box::new(record), workflow))
    }

    async fn run_workflow(
        &self,
        record: RunRecord,
        workflow: WorkflowFn,
        stop: &mut watch::Receiver<bool>,
    ) -> RunEnd {
        let run = record.id.clone();
        let ctx = RunContext::new(
            self.journal.clone(),
            &run,
            record.workflow.as_deref().unwrap_or_default(),
            record.input.as_deref(),
        );
        // Its own task: a panic is the run's failure, not the worker's, and stopping it is an
        // abort (also when this future is dropped: the workflow never outlives its claim).
        let mut task = Task(tokio::spawn(workflow(ctx)));
        let ended = tokio::select! {
            joined = &mut task.0 => joined,
            lost = self.keep_claim(&run) => {
                task.stop().await;
                return self.after_losing(&run, lost).await;
            }
            Ok(()) = stop.changed() => {
                task.stop().await;
                return self.give_back(&run, "the worker shut down".into()).await;
            }
        };
        let result = match ended {
            Ok(result) => result,
            Err(joined) => Err(RunError::Failed(format!(
                "the workflow panicked: {}",
                panic_message(joined)
            ))),
        };
        self.conclude(&run, result).await
    }

    /// Renews the lease every third of it, until it cannot: the worker lost the run (another
    /// claimed it, an operator cancelled it) or could not reach the journal for a whole lease.
    async fn keep_claim(&self, run: &str) -> Lost {
        let mut renewed = Instant::now();
        loop {
            tokio::time::sleep(self.lease / 3).await;
            match self.journal.renew(run, &self.id, self.lease).await {
                Ok(true) => renewed = Instant::now(),
                Ok(false) => return Lost::Claim,
                Err(e) if renewed.elapsed() >= self.lease => return Lost::Store(e),
                Err(_) => {}
            }
        }
    }

    async fn after_losing(&self, run: &str, lost: Lost) -> RunEnd {
        match lost {
            Lost::Store(e) => RunEnd::Released {
                why: format!("the lease could not be renewed: {}", CauseChain(&e)),
            },
            Lost::Claim => match self.journal.runs().get(run).await {
                Ok(Some(r)) if r.state == RunState::Cancelled => RunEnd::Cancelled,
                Ok(Some(r)) => RunEnd::Released {
                    why: format!(
                        "the claim was lost (the run is {}, held by {})",
                        r.state,
                        r.claimed_by.as_deref().unwrap_or("nobody")
                    ),
                },
                Ok(None) => RunEnd::Released {
                    why: "the run is gone".into(),
                },
                Err(e) => RunEnd::Released {
                    why: format!(
                        "the claim was lost, and the journal failed: {}",
                        CauseChain(&e)
                    ),
                },
            },
        }
    }

    /// Records how the workflow ended.
    async fn conclude(&self, run: &str, result: WorkflowResult) -> RunEnd {
        let written = match result {
            Ok(output) => self
                .journal
                .finish_run(
                    run,
                    &self.id,
                    RunOutcome::Succeeded {
                        output: output.clone(),
                    },
                )
                .await
                .map(|_| RunEnd::Succeeded { output }),
            Err(RunError::Parked { step, until }) => {
                let why = format!("step {step} is parked");
                self.journal
                    .defer_run(run, &self.id, until, &why)
                    .await
                    .map(|_| RunEnd::Deferred { until, why })
            }
            Err(RunError::NotYet { step, error }) => {
                let until = crate::journal::later(self.journal.now(), self.retry_delay);
                let why = format!("step {step} is not done yet: {error}");
                self.journal
                    .defer_run(run, &self.id, until, &why)
                    .await
                    .map(|_| RunEnd::Deferred { until, why })
            }
            Err(RunError::NeedsHuman { why }) => self
                .journal
                .run_needs_human(run, &self.id, &why)
                .await
                .map(|_| RunEnd::NeedsHuman { why }),
            Err(RunError::Journal(e)) => {
                return self
                    .give_back(run, format!("the journal failed: {}", CauseChain(&e)))
                    .await;
            }
            Err(e @ (RunError::StepFailed(_) | RunError::Failed(_))) => {
                let error = e.to_string();
                self.journal
                    .finish_run(
                        run,
                        &self.id,
                        RunOutcome::Failed {
                            error: error.clone(),
                        },
                    )
                    .await
                    .map(|_| RunEnd::Failed { error })
            }
        };
        match written {
            Ok(end) => end,
            // Cancelled (or claimed by another) while it ran: the record says which.
            Err(JournalError::RunRefused { why, .. }) => match self.journal.runs().get(run).await {
                Ok(Some(r)) if r.state == RunState::Cancelled => RunEnd::Cancelled,
                _ => RunEnd::Released { why },
            },
            Err(e) => {
                self.give_back(run, format!("the journal failed: {}", CauseChain(&e)))
                    .await
            }
        }
    }

    /// Gives the claim back, pending.
    async fn give_back(&self, run: &str, why: String) -> RunEnd {
        if let Err(e) = self.journal.release(run, &self.id).await {
            // The lease runs out by itself.
            tracing::warn!(target: "backstop::journal", run, error = %CauseChain(&e), "release failed");
        }
        RunEnd::Released { why }
    }
}

/// A workflow's task, aborted when dropped.
struct Task(tokio::task::JoinHandle<WorkflowResult>);

impl Task {
    /// Aborts the workflow and waits until it has stopped (nothing of it runs after this).
    async fn stop(&mut self) {
        self.0.abort();
        let _ = (&mut self.0).await;
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

enum Prepared {
    Run(Box<RunRecord>, WorkflowFn),
    Ended(RunEnd),
}

enum Lost {
    Claim,
    Store(JournalError),
}

fn panic_message(e: tokio::task::JoinError) -> String {
    match e.try_into_panic() {
        Ok(p) => p
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a non-text panic".into()),
        Err(e) => e.to_string(),
    }
}
