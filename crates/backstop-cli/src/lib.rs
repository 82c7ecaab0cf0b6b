//! `backstop`: the operator's view of the step journal, as a command (`src/main.rs`) and as a
//! library ([`run`]) for programs that show the same tables.
//!
//! ```text
//! backstop journal runs [--state STATE] [--workflow NAME]
//!                                            recent runs, their state, steps needing attention
//! backstop journal show RUN                  the run's record, its steps and what happened to it
//! backstop journal stuck                     steps waiting for a person, parked steps
//! backstop journal resolve RUN STEP --succeeded|--failed|--retry --by WHO --why WHY
//! backstop journal cancel RUN --by WHO --why WHY
//! backstop journal retry RUN STEP --by WHO --why WHY
//! backstop journal stub RUN STEP --result JSON --by WHO --why WHY
//! backstop journal fork RUN --from STEP --as NEW --by WHO --why WHY
//! backstop journal serve [--listen 127.0.0.1:8765] [--allow-actions]
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
//! instead of calling the tool; `fork` makes a new pending run of an ended one whose steps
//! before STEP keep their results and whose steps from STEP on run anew under the new run's
//! keys. Each is recorded with who and why, and `retry` and `stub` put the run back to pending
//! for a worker to go on with.
//!
//! The journal is `--db URL` (or `BACKSTOP_JOURNAL`): a SQLite file (`path/to/journal.db` or
//! `sqlite://path`) or `postgres://...`; the default is `backstop-journal.db` here. `--json` on
//! every command prints JSON for scripts. Exit codes: 0 done; 1 the journal's database failed;
//! 2 the command line is wrong (a `--result` that is not JSON too); 3 no such journal, run or
//! step; 4 the action was refused (the step or the run is not in a state that allows it, or
//! another worker moved it); 5 `stuck --fail-if-any` found steps.
#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges every item behind a feature with it.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

use args::{Cli, Command, JournalArgs, JournalCommand};
use backstop_core::plumbing::CauseChain;
use backstop_journal::{ErrorKind, Journal, JournalError};
use clap::Parser;

mod actions;
mod args;
mod console;
mod letters;
mod reads;
mod render;

/// What went wrong, and the exit code it gets.
struct Failure {
    code: u8,
    message: String,
}

impl From<JournalError> for Failure {
    fn from(e: JournalError) -> Self {
        let code = match e.kind() {
            ErrorKind::NotFound => 3,
            ErrorKind::Refused => 4,
            _ => 1,
        };
        Failure {
            code,
            message: CauseChain(&e).to_string(),
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
        message: format!("cannot open the journal at {db}: {}", CauseChain(&e)),
    })
}

async fn journal(args: JournalArgs) -> Result<u8, Failure> {
    let j = open(&args.db).await?;
    let now = j.now();
    let json = args.json;
    match args.command {
        JournalCommand::Runs {
            limit,
            state,
            workflow,
        } => {
            let mut filter = backstop_journal::RunFilter::latest(limit);
            filter.state = state.map(Into::into);
            filter.workflow = workflow;
            reads::runs(&j, json, now, &filter).await
        }
        JournalCommand::Show { run } => reads::show(&j, json, now, &run).await,
        JournalCommand::Stuck { fail_if_any } => reads::stuck(&j, json, now, fail_if_any).await,
        JournalCommand::Resolve(r) => actions::resolve(&j, json, r).await,
        JournalCommand::Cancel { run, who } => actions::cancel(&j, json, &run, who).await,
        JournalCommand::Retry { step, who } => actions::retry(&j, json, &step, who).await,
        JournalCommand::Stub { step, result, who } => {
            actions::stub(&j, json, &step, &result, who).await
        }
        JournalCommand::Serve {
            listen,
            allow_actions,
        } => console::serve(j, listen, allow_actions).await,
        JournalCommand::Fork {
            run,
            from_step,
            new_run,
            who,
        } => actions::fork(&j, json, (&run, &from_step, &new_run), who).await,
    }
}
