//! The command line: its commands and their arguments, as clap parses them.

use crate::letters;
use backstop_journal::RunState;
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::Value;

#[derive(Parser, Debug)]
#[command(name = "backstop", version, about = "Backstop's operator tools")]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// The step journal: what every run did, and what needs a person.
    Journal(JournalArgs),
    /// Dead letters on a Redis stream: list them, read them with a consumer group, acknowledge.
    Letters(letters::LettersArgs),
}

/// The exit codes, as `--help` shows them (the crate docs say the same).
pub(crate) const EXIT_CODES: &str = "Exit codes: 0 done; 1 the journal's database failed; 2 the command \
line is wrong (a --result that is not JSON too); 3 no such journal, run or step; 4 the action \
was refused (the step or the run is not in a state that allows it, or another worker moved it); 5 stuck --fail-if-any \
found steps.";

#[derive(Args, Debug)]
#[command(after_help = EXIT_CODES)]
pub(crate) struct JournalArgs {
    /// The journal: a SQLite file (`journal.db`, `sqlite://PATH`) or `postgres://...`.
    #[arg(
        long,
        env = "BACKSTOP_JOURNAL",
        default_value = "backstop-journal.db",
        global = true
    )]
    pub(crate) db: String,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    pub(crate) json: bool,
    #[command(subcommand)]
    pub(crate) command: JournalCommand,
}

#[derive(Subcommand, Debug)]
pub(crate) enum JournalCommand {
    /// Recent runs: their state and the steps that need attention.
    Runs {
        /// How many runs, most recently changed first.
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Only runs in this state.
        #[arg(long, value_enum)]
        state: Option<StateArg>,
        /// Only runs of this workflow.
        #[arg(long)]
        workflow: Option<String>,
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
        #[command(flatten)]
        step: StepRef,
        #[command(flatten)]
        who: Who,
    },
    /// Serves the journal in a browser: runs, one run, what needs a person; the operator's
    /// actions as forms with --allow-actions.
    Serve {
        /// Where to listen (a loopback address unless the network in front is trusted).
        #[arg(long, default_value = "127.0.0.1:8765")]
        listen: std::net::SocketAddr,
        /// Show the actions' forms and accept them (read-only without it).
        #[arg(long)]
        allow_actions: bool,
    },
    /// Forks an ended run at a step: a new run whose earlier steps keep their results and
    /// whose steps from STEP on run anew, under the new run's keys.
    Fork {
        /// The run to fork (succeeded, failed or cancelled).
        run: String,
        /// The step from which the new run runs anew.
        #[arg(long = "from", value_name = "STEP")]
        from_step: String,
        /// The new run's id.
        #[arg(long = "as", value_name = "NEW")]
        new_run: String,
        #[command(flatten)]
        who: Who,
    },
    /// Writes the result the workflow will see for a step, instead of calling its tool.
    Stub {
        #[command(flatten)]
        step: StepRef,
        /// The result, as JSON.
        #[arg(long, value_parser = parse_json)]
        result: String,
        #[command(flatten)]
        who: Who,
    },
}

/// Who acts, and why (recorded in the history).
#[derive(Args, Debug)]
pub(crate) struct Who {
    /// Who decides.
    #[arg(long)]
    pub(crate) by: String,
    /// Why, in words.
    #[arg(long)]
    pub(crate) why: String,
}

/// One step of a run, as the commands that act on a step name it.
#[derive(Args, Debug)]
pub(crate) struct StepRef {
    /// The run.
    pub(crate) run: String,
    /// The step.
    pub(crate) step: String,
    /// The tool call within the step, when it has one.
    #[arg(long, default_value = "")]
    pub(crate) call: String,
}

impl StepRef {
    /// The step's id in the journal.
    pub(crate) fn id(&self) -> backstop_journal::StepId {
        backstop_journal::StepId::new(&self.run, &self.step, &self.call)
    }
}

/// A run's state, as `--state` takes it (clap lists the values in `--help` and completions).
#[derive(ValueEnum, Clone, Copy, Debug)]
#[value(rename_all = "snake_case")]
pub(crate) enum StateArg {
    /// Not finished.
    Pending,
    /// The workflow finished it.
    Succeeded,
    /// The workflow failed.
    Failed,
    /// An operator cancelled it.
    Cancelled,
    /// A person must decide a step.
    NeedsHuman,
}

impl From<StateArg> for RunState {
    fn from(s: StateArg) -> RunState {
        match s {
            StateArg::Pending => RunState::Pending,
            StateArg::Succeeded => RunState::Succeeded,
            StateArg::Failed => RunState::Failed,
            StateArg::Cancelled => RunState::Cancelled,
            StateArg::NeedsHuman => RunState::NeedsHuman,
        }
    }
}

pub(crate) fn parse_json(s: &str) -> Result<String, String> {
    serde_json::from_str::<Value>(s)
        .map(|_| s.to_owned())
        .map_err(|e| format!("the result must be JSON ({e}); a string is quoted: '\"text\"'"))
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("resolution").required(true).args(["succeeded", "failed", "retry"])))]
pub(crate) struct ResolveArgs {
    #[command(flatten)]
    pub(crate) step: StepRef,
    /// It happened (you checked with the provider).
    #[arg(long)]
    pub(crate) succeeded: bool,
    /// The result to store with --succeeded, as JSON.
    #[arg(long, requires = "succeeded", value_parser = parse_json)]
    pub(crate) result: Option<String>,
    /// It did not take effect and must not be retried.
    #[arg(long)]
    pub(crate) failed: bool,
    /// It did not take effect: send it again, with the same key.
    #[arg(long)]
    pub(crate) retry: bool,
    #[command(flatten)]
    pub(crate) who: Who,
}
