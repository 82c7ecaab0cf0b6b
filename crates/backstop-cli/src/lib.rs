//! `backstop`: the operator's view of the step journal, as a command (`src/main.rs`) and as a
//! library ([`run`]) for programs that show the same tables.
//!
//! ```text
//! backstop journal runs [--state STATE]      recent runs, their state, steps needing attention
//! backstop journal show RUN                  the run's record, its steps and what happened to it
//! backstop journal stuck                     steps waiting for a person, parked steps
//! backstop journal resolve RUN STEP --succeeded|--failed|--retry --by WHO --why WHY
//! backstop journal cancel RUN --by WHO --why WHY
//! backstop journal retry RUN STEP --by WHO --why WHY
//! backstop journal stub RUN STEP --result JSON --by WHO --why WHY
//! ```
//!
//! ```text
//! backstop letters list [--count N]                 dead letters on the stream, oldest first
//! backstop letters read --group G --consumer C      letters not yet given to anyone in group G
//! backstop letters ack --group G ID...              settled: acknowledged for group G
//! ```
//!
//! The stream is `--redis URL` (or `BACKSTOP_REDIS`) and `--stream NAME` (`dead-letters` by
//! default), as `RedisStreamSink` writes it.
//!
//! `STATE` is one of `pending`, `succeeded`, `failed`, `cancelled`, `needs_human`. `cancel`
//! stops a run for good (the worker running it stops within a third of its lease); `retry`
//! sends a failed step again with the same key; `stub` writes the result the workflow will see
//! instead of calling the tool. Each is recorded with who and why, and `retry` and `stub` put
//! the run back to pending for a worker to go on with.
//!
//! The journal is `--db URL` (or `BACKSTOP_JOURNAL`): a SQLite file (`path/to/journal.db` or
//! `sqlite://path`) or `postgres://...`; the default is `backstop-journal.db` here. `--json` on
//! every command prints JSON for scripts. Exit codes: 0 done; 1 the journal's database failed;
//! 2 the command line is wrong (a `--result` that is not JSON too); 3 no such journal, run or
//! step; 4 the action was refused (the step or the run is over, or another worker moved it);
//! 5 `stuck --fail-if-any` found steps.
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

use args::{Cli, Command, JournalArgs, JournalCommand};
use backstop_journal::{Journal, JournalError, Resolution, Step, StepId, StepTransition};
use clap::Parser;
use render::{
    ago, event_json, human, print_json, run_json, run_record_json, short_key, step_json, table,
    time_in_states, transition_json, when,
};
use serde_json::{Value, json};

mod args;
mod letters;
mod render;

/// What went wrong, and the exit code it gets.
struct Failure {
    code: u8,
    message: String,
}

impl From<JournalError> for Failure {
    fn from(e: JournalError) -> Self {
        let code = match e {
            JournalError::NotFound(_) => 3,
            JournalError::Conflict { .. }
            | JournalError::AlreadyDone(_)
            | JournalError::RunRefused { .. } => 4,
            _ => 1,
        };
        Failure {
            code,
            message: e.to_string(),
        }
    }
}

/// Runs the command line `args` (its first item is the program's name) and returns the exit
/// code; what the command prints goes to standard output and standard error.
pub async fn run<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return u8::try_from(e.exit_code()).unwrap_or(2);
        }
    };
    let result = match cli.command {
        Command::Journal(args) => journal(args).await,
        Command::Letters(args) => letters::run(args).await,
    };
    match result {
        Ok(code) => code,
        Err(f) => {
            eprintln!("backstop: {}", f.message);
            f.code
        }
    }
}

async fn open(db: &str) -> Result<Journal, Failure> {
    let remote = db.starts_with("postgres://") || db.starts_with("postgresql://");
    if !remote {
        let path = db.strip_prefix("sqlite://").unwrap_or(db);
        if !std::path::Path::new(path).exists() {
            return Err(Failure {
                code: 3,
                message: format!(
                    "no journal at {path}: give the journal with --db PATH (or BACKSTOP_JOURNAL), \
                     or postgres://... for a shared one"
                ),
            });
        }
    }
    Journal::open(db).await.map_err(|e| Failure {
        code: 1,
        message: format!("cannot open the journal at {db}: {e}"),
    })
}

async fn journal(args: JournalArgs) -> Result<u8, Failure> {
    let j = open(&args.db).await?;
    let now = j.now_ms();
    match args.command {
        JournalCommand::Runs { limit, state } => {
            let runs = match state {
                Some(state) => j.runs_in(state, limit).await?,
                None => j.runs(limit).await?,
            };
            if args.json {
                print_json(&Value::Array(runs.iter().map(run_json).collect()));
            } else if runs.is_empty() {
                println!("no runs in the journal");
            } else {
                let mut t = table(&[
                    "run",
                    "workflow",
                    "state",
                    "steps",
                    "done",
                    "need a person",
                    "parked",
                    "in doubt",
                    "updated",
                    "claimed by",
                ]);
                for r in &runs {
                    t.add_row(vec![
                        r.run.clone(),
                        r.workflow.clone().unwrap_or_default(),
                        r.state.to_string(),
                        r.steps.to_string(),
                        r.done.to_string(),
                        r.needs_human.to_string(),
                        r.parked.to_string(),
                        r.unknown.to_string(),
                        ago(now, r.updated_ms),
                        r.claimed_by.clone().unwrap_or_default(),
                    ]);
                }
                println!("{t}");
            }
            Ok(0)
        }
        JournalCommand::Show { run } => {
            // A fixed number of queries, however many steps: the record, the steps, every
            // transition of the run, the run's events.
            let Some(record) = j.run_record(&run).await? else {
                return Err(Failure {
                    code: 3,
                    message: format!(
                        "run {run} is not in the journal (see `backstop journal runs`)"
                    ),
                });
            };
            let steps = j.run(&run).await?;
            let mut history = j.run_history(&run).await?;
            let events = j.run_events(&run).await?;
            let rows: Vec<(&Step, Vec<StepTransition>)> = steps
                .iter()
                .map(|s| {
                    let (mine, rest) = std::mem::take(&mut history)
                        .into_iter()
                        .partition(|t| t.id == s.id);
                    history = rest;
                    (s, mine)
                })
                .collect();
            if args.json {
                let v = json!({
                    "run": run_record_json(&record),
                    "events": events.iter().map(event_json).collect::<Vec<_>>(),
                    "steps": rows
                    .iter()
                    .map(|(s, h)| {
                        let mut v = step_json(s);
                        v["history"] = Value::Array(h.iter().map(transition_json).collect());
                        v["time_in_state_ms"] = json!(
                            time_in_states(h, now)
                                .into_iter()
                                .map(|(st, ms)| (st.to_owned(), json!(ms)))
                                .collect::<serde_json::Map<_, _>>()
                        );
                        v
                    })
                    .collect::<Vec<_>>(),
                });
                print_json(&v);
            } else {
                let mut t = table(&[
                    "step",
                    "call",
                    "tool",
                    "state",
                    "attempts",
                    "key",
                    "last error",
                    "time in each state",
                ]);
                for (s, h) in &rows {
                    let times = time_in_states(h, now)
                        .into_iter()
                        .map(|(st, ms)| match ms {
                            Some(ms) => format!("{st} {}", human(ms)),
                            None => st.to_owned(),
                        })
                        .collect::<Vec<_>>()
                        .join(", ");
                    let state = match (&s.attention, s.park_until) {
                        (Some(_), _) => format!("{} (needs a person)", s.state),
                        (None, Some(at)) if s.state == backstop_journal::StepState::Parked => {
                            format!("parked (wakes {})", when(now, at))
                        }
                        _ => s.state.to_string(),
                    };
                    t.add_row(vec![
                        s.id.step.to_string(),
                        s.id.call.to_string(),
                        s.tool.clone(),
                        state,
                        s.attempts.to_string(),
                        short_key(&s.key),
                        s.last_error
                            .clone()
                            .or_else(|| s.attention.clone())
                            .unwrap_or_default(),
                        times,
                    ]);
                }
                let mut head = format!("run {run}: {}", record.state);
                if let Some(w) = &record.workflow {
                    head.push_str(&format!(" (workflow {w})"));
                }
                if let Some(e) = &record.error {
                    head.push_str(&format!(": {e}"));
                }
                println!("{head}");
                if steps.is_empty() {
                    println!("no steps yet");
                } else {
                    println!("{t}");
                }
                for e in &events {
                    println!(
                        "{} {} by {}{}",
                        ago(now, e.at_ms),
                        e.action,
                        e.actor,
                        e.reason
                            .as_deref()
                            .map(|r| format!(": {r}"))
                            .unwrap_or_default()
                    );
                }
            }
            Ok(0)
        }
        JournalCommand::Stuck { fail_if_any } => {
            let stuck = j.stuck().await?;
            if args.json {
                print_json(&Value::Array(stuck.iter().map(step_json).collect()));
            } else if stuck.is_empty() {
                println!("nothing is stuck: no step waits for a person, none is parked");
            } else {
                let mut t = table(&[
                    "run",
                    "step",
                    "call",
                    "tool",
                    "state",
                    "waiting for",
                    "since",
                ]);
                for s in &stuck {
                    let waiting = match (&s.attention, s.park_until) {
                        (Some(why), _) => format!("a person: {why}"),
                        (None, Some(at)) => format!("its time: wakes {}", when(now, at)),
                        (None, None) => String::new(),
                    };
                    t.add_row(vec![
                        s.id.run.to_string(),
                        s.id.step.to_string(),
                        s.id.call.to_string(),
                        s.tool.clone(),
                        s.state.to_string(),
                        waiting,
                        ago(now, s.updated_ms),
                    ]);
                }
                println!("{t}");
            }
            Ok(if fail_if_any && !stuck.is_empty() {
                5
            } else {
                0
            })
        }
        JournalCommand::Resolve(r) => {
            let resolution = if r.succeeded {
                Resolution::Succeeded { result: r.result }
            } else if r.failed {
                Resolution::Failed
            } else {
                Resolution::Retry
            };
            let id = StepId::new(&r.run, &r.step, &r.call);
            if j.step(&id).await?.is_none() {
                return Err(Failure {
                    code: 3,
                    message: format!(
                        "step {id} is not in the journal (see `backstop journal show {}`)",
                        r.run
                    ),
                });
            }
            let step = j.resolve(&id, resolution, &r.by, &r.why).await?;
            if args.json {
                print_json(&step_json(&step));
            } else {
                println!("step {id} is now {} (by {}: {})", step.state, r.by, r.why);
            }
            Ok(0)
        }
        JournalCommand::Cancel { run, who } => {
            let record = j.cancel_run(&run, &who.by, &who.why).await?;
            if args.json {
                print_json(&run_record_json(&record));
            } else {
                println!("run {run} is cancelled (by {}: {})", who.by, who.why);
            }
            Ok(0)
        }
        JournalCommand::Retry {
            run,
            step,
            call,
            who,
        } => {
            let id = StepId::new(&run, &step, &call);
            let step = j.retry_step(&id, &who.by, &who.why).await?;
            if args.json {
                print_json(&step_json(&step));
            } else {
                println!(
                    "step {id} is {} and will be sent again with key {} (by {}: {})",
                    step.state, step.key, who.by, who.why
                );
            }
            Ok(0)
        }
        JournalCommand::Stub {
            run,
            step,
            call,
            result,
            who,
        } => {
            let id = StepId::new(&run, &step, &call);
            let step = j.stub_step(&id, &result, &who.by, &who.why).await?;
            if args.json {
                print_json(&step_json(&step));
            } else {
                println!(
                    "step {id} is {} with the result you gave (by {}: {})",
                    step.state, who.by, who.why
                );
            }
            Ok(0)
        }
    }
}
