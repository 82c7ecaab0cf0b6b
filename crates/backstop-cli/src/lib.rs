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

use backstop_journal::{
    Journal, JournalError, Resolution, RunEvent, RunRecord, RunState, RunSummary, Step, StepId,
    StepTransition,
};
use clap::{Args, Parser, Subcommand};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use serde_json::{Value, json};
use std::time::{Duration, UNIX_EPOCH};

#[derive(Parser, Debug)]
#[command(name = "backstop", version, about = "Backstop's operator tools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The step journal: what every run did, and what needs a person.
    Journal(JournalArgs),
    /// Dead letters on a Redis stream: list them, read them with a consumer group, acknowledge.
    Letters(letters::LettersArgs),
}

/// The exit codes, as `--help` shows them (the crate docs say the same).
const EXIT_CODES: &str = "Exit codes: 0 done; 1 the journal's database failed; 2 the command \
line is wrong (a --result that is not JSON too); 3 no such journal, run or step; 4 the action \
was refused (the step or the run is over, or another worker moved it); 5 stuck --fail-if-any \
found steps.";

#[derive(Args, Debug)]
#[command(after_help = EXIT_CODES)]
struct JournalArgs {
    /// The journal: a SQLite file (`journal.db`, `sqlite://PATH`) or `postgres://...`.
    #[arg(
        long,
        env = "BACKSTOP_JOURNAL",
        default_value = "backstop-journal.db",
        global = true
    )]
    db: String,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: JournalCommand,
}

#[derive(Subcommand, Debug)]
enum JournalCommand {
    /// Recent runs: their state and the steps that need attention.
    Runs {
        /// How many runs, most recently changed first.
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Only runs in this state: pending, succeeded, failed, cancelled, needs_human.
        #[arg(long, value_parser = parse_run_state)]
        state: Option<RunState>,
    },
    /// One run's steps: state, attempts, key, last error, time in each state.
    Show {
        /// The run.
        run: String,
    },
    /// Steps waiting for a person, and parked steps with when they wake.
    Stuck {
        /// Exit with 5 when there are any (for a script or a cron check).
        #[arg(long)]
        fail_if_any: bool,
    },
    /// Repairs a step that is not over, recording who and why.
    Resolve(ResolveArgs),
    /// Cancels a run: no worker runs it again.
    Cancel {
        /// The run.
        run: String,
        #[command(flatten)]
        who: Who,
    },
    /// Sends a failed step again, with the same key; its run goes back to pending.
    Retry {
        /// The run.
        run: String,
        /// The step.
        step: String,
        /// The tool call within the step, when it has one.
        #[arg(long, default_value = "")]
        call: String,
        #[command(flatten)]
        who: Who,
    },
    /// Writes the result the workflow will see for a step, instead of calling its tool.
    Stub {
        /// The run.
        run: String,
        /// The step.
        step: String,
        /// The tool call within the step, when it has one.
        #[arg(long, default_value = "")]
        call: String,
        /// The result, as JSON.
        #[arg(long, value_parser = parse_json)]
        result: String,
        #[command(flatten)]
        who: Who,
    },
}

/// Who acts, and why (recorded in the history).
#[derive(Args, Debug)]
struct Who {
    /// Who decides.
    #[arg(long)]
    by: String,
    /// Why, in words.
    #[arg(long)]
    why: String,
}

fn parse_run_state(s: &str) -> Result<RunState, String> {
    s.parse().map_err(|_| {
        let names: Vec<_> = RunState::ALL.iter().map(|s| s.as_str()).collect();
        format!("{s:?} is not a run state: one of {}", names.join(", "))
    })
}

fn parse_json(s: &str) -> Result<String, String> {
    serde_json::from_str::<Value>(s)
        .map(|_| s.to_owned())
        .map_err(|e| format!("the result must be JSON ({e}); a string is quoted: '\"text\"'"))
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("resolution").required(true).args(["succeeded", "failed", "retry"])))]
struct ResolveArgs {
    /// The run.
    run: String,
    /// The step.
    step: String,
    /// The tool call within the step, when it has one.
    #[arg(long, default_value = "")]
    call: String,
    /// It happened (you checked with the provider).
    #[arg(long)]
    succeeded: bool,
    /// The result to store with --succeeded, as JSON.
    #[arg(long, requires = "succeeded", value_parser = parse_json)]
    result: Option<String>,
    /// It did not take effect and must not be retried.
    #[arg(long)]
    failed: bool,
    /// It did not take effect: send it again, with the same key.
    #[arg(long)]
    retry: bool,
    /// Who decides.
    #[arg(long)]
    by: String,
    /// Why, in words (recorded in the step's history).
    #[arg(long)]
    why: String,
}

mod letters;

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

fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(header.to_vec());
    t
}

fn print_json(v: &Value) {
    println!("{}", serde_json::to_string_pretty(v).expect("JSON"));
}

fn run_json(r: &RunSummary) -> Value {
    json!({
        "run": r.run, "workflow": r.workflow, "state": r.state.as_str(), "steps": r.steps,
        "done": r.done, "needs_human": r.needs_human, "parked": r.parked, "unknown": r.unknown,
        "updated_ms": r.updated_ms, "claimed_by": r.claimed_by, "wake_ms": r.wake_ms,
        "error": r.error,
    })
}

fn run_record_json(r: &RunRecord) -> Value {
    json!({
        "run": r.id, "workflow": r.workflow, "input": r.input, "state": r.state.as_str(),
        "output": r.output, "error": r.error, "claimed_by": r.claimed_by,
        "claim_until_ms": r.claim_until, "wake_ms": r.wake_ms, "created_ms": r.created_ms,
        "updated_ms": r.updated_ms,
    })
}

fn event_json(e: &RunEvent) -> Value {
    json!({ "at_ms": e.at_ms, "actor": e.actor, "action": e.action, "reason": e.reason })
}

fn step_json(s: &Step) -> Value {
    json!({
        "run": &*s.id.run, "step": &*s.id.step, "call": &*s.id.call, "tool": s.tool,
        "kind": s.kind.as_str(), "state": s.state.as_str(), "outcome": s.state.outcome().as_str(),
        "attempts": s.attempts, "key": s.key, "last_error": s.last_error, "result": s.result,
        "provider_ref": s.provider_ref, "park_until_ms": s.park_until, "needs_human": s.attention,
        "created_ms": s.created_ms, "updated_ms": s.updated_ms, "sent_ms": s.sent_ms,
    })
}

fn transition_json(t: &StepTransition) -> Value {
    json!({
        "from": t.from.map(|s| s.as_str()), "to": t.to.as_str(), "at_ms": t.at_ms,
        "attempts": t.attempts, "error": t.error, "actor": t.actor, "reason": t.reason,
    })
}

/// How long the step spent in each state it passed through, summed, in order of first visit.
/// The state it is in now counts until now, unless it is final (a step over is not "waiting").
fn time_in_states(history: &[StepTransition], now: i64) -> Vec<(&'static str, Option<i64>)> {
    let mut out: Vec<(&'static str, Option<i64>)> = Vec::new();
    for (i, t) in history.iter().enumerate() {
        let spent = match history.get(i + 1) {
            Some(next) => Some((next.at_ms - t.at_ms).max(0)),
            None if t.to.is_final() => None,
            None => Some((now - t.at_ms).max(0)),
        };
        match out.iter_mut().find(|(s, _)| *s == t.to.as_str()) {
            Some((_, ms)) => *ms = Some(ms.unwrap_or(0) + spent.unwrap_or(0)),
            None => out.push((t.to.as_str(), spent)),
        }
    }
    out
}

fn human(ms: i64) -> String {
    let ms = ms.max(0);
    if ms < 1_000 {
        format!("{ms} ms")
    } else if ms < 120_000 {
        format!("{:.1} s", ms as f64 / 1_000.0)
    } else if ms < 7_200_000 {
        format!("{} min", (ms + 30_000) / 60_000)
    } else {
        format!("{:.1} h", ms as f64 / 3_600_000.0)
    }
}

fn ago(now: i64, at: i64) -> String {
    format!("{} ago", human(now - at))
}

fn when(now: i64, at: i64) -> String {
    let date = UNIX_EPOCH + Duration::from_millis(u64::try_from(at).unwrap_or(0));
    if at > now {
        format!("in {} ({})", human(at - now), httpdate::fmt_http_date(date))
    } else {
        format!("now (due {})", httpdate::fmt_http_date(date))
    }
}

fn short_key(key: &str) -> String {
    if key.len() > 16 {
        format!("{}…", &key[..16])
    } else {
        key.to_owned()
    }
}
