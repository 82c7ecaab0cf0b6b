//! The commands that read the journal: recent runs, one run in full, what is stuck.

use crate::Failure;
use crate::render::{
    RunShown, StepShown, ago, human, print_json, short_key, table, time_in_states, when,
};
use backstop_journal::{Journal, RunFilter, Step, StepTransition};
use chrono::{DateTime, Utc};

/// `runs`: the most recently changed runs that `filter` selects.
pub(crate) async fn runs(
    j: &Journal,
    json: bool,
    now: DateTime<Utc>,
    filter: &RunFilter,
) -> Result<u8, Failure> {
    let runs = j.runs().list(filter).await?;
    if json {
        print_json(&runs);
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
                ago(now, r.updated_at),
                r.claimed_by.clone().unwrap_or_default(),
            ]);
        }
        println!("{t}");
    }
    Ok(0)
}

/// `show`: one run's record, steps with their history, and events.
pub(crate) async fn show(
    j: &Journal,
    json: bool,
    now: DateTime<Utc>,
    run: &str,
) -> Result<u8, Failure> {
    // A fixed number of queries, however many steps: the record, the steps, every
    // transition of the run, the run's events, the runs forked from it.
    let Some(record) = j.runs().get(run).await? else {
        return Err(Failure {
            code: 3,
            message: format!("run {run} is not in the journal (see `backstop journal runs`)"),
        });
    };
    let steps = j.runs().steps(run).await?;
    let mut history = j.runs().history(run).await?;
    let events = j.runs().events(run).await?;
    let forks = j.runs().forks(run).await?;
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
    if json {
        print_json(&RunShown {
            run: &record,
            events: &events,
            forks: &forks,
            steps: rows
                .iter()
                .map(|(step, history)| StepShown {
                    step,
                    history,
                    time_in_state_ms: time_in_states(history, now).into_iter().collect(),
                })
                .collect(),
        });
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
            let state = match (&s.attention, s.parked_until) {
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
        if let Some(from) = &record.forked_from {
            println!("forked from run {} at step {}", from.run, from.step);
        }
        for f in &forks {
            if let Some(from) = &f.forked_from {
                println!(
                    "forked into run {} at step {} ({})",
                    f.id, from.step, f.state
                );
            }
        }
        if steps.is_empty() {
            println!("no steps yet");
        } else {
            println!("{t}");
        }
        for e in &events {
            println!(
                "{} {} by {}{}",
                ago(now, e.at),
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

/// `stuck`: steps waiting for a person, and parked steps.
pub(crate) async fn stuck(
    j: &Journal,
    json: bool,
    now: DateTime<Utc>,
    fail_if_any: bool,
) -> Result<u8, Failure> {
    let stuck = j.runs().stuck().await?;
    if json {
        print_json(&stuck);
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
            let waiting = match (&s.attention, s.parked_until) {
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
                ago(now, s.updated_at),
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
