//! The console's pages: runs (filtered by state and workflow), one run, what needs a person.
//! Rendered with maud, which escapes every value it is given: a step named `<b>` shows as text.

use super::{Console, ConsoleError, encode};
use crate::render::{ago, human, short_key, time_in_states, when};
use axum::{
    extract::{Path, Query, State},
    http::StatusCode,
    response::Html,
};
use backstop_journal::{RunFilter, RunState, Step, StepTransition};
use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};
use serde::Deserialize;
use std::sync::Arc;

const STYLE: &str = "body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}\
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.3em .6em;\
text-align:left;vertical-align:top}th{background:#f3f3f3}nav a{margin-right:1em}\
.state{font-weight:600}.failed,.needs_human,.cancelled{color:#a00}.succeeded{color:#070}\
.pending{color:#a60}form{margin:.4em 0;padding:.5em;border:1px solid #ddd;background:#fafafa}\
input,select{margin-right:.4em}code{font-size:12px}.err{color:#a00}";

/// A whole page around `body`.
fn page(title: &str, body: Markup) -> Html<String> {
    Html(
        html! {
            (DOCTYPE)
            html lang="en" {
                head {
                    meta charset="utf-8";
                    title { (title) " · Backstop journal" }
                    style { (maud::PreEscaped(STYLE)) }
                }
                body {
                    nav { a href="/" { "Runs" } a href="/stuck" { "Needs a person" } }
                    h1 { (title) }
                    (body)
                }
            }
        }
        .into_string(),
    )
}

/// The page for an error.
pub(crate) fn error_page(status: StatusCode, message: &str) -> Html<String> {
    page(
        &format!("{}", status.as_u16()),
        html! { p.err { (message) } p { a href="/" { "Back to the runs" } } },
    )
}

#[derive(Deserialize)]
pub(crate) struct RunsQuery {
    state: Option<String>,
    workflow: Option<String>,
}

/// `/`: the 500 most recently changed runs of the state and workflow asked for (the journal
/// filters before it counts).
pub(crate) async fn runs(
    State(c): State<Arc<Console>>,
    Query(q): Query<RunsQuery>,
) -> Result<Html<String>, ConsoleError> {
    let state = match q.state.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some(s) => Some(
            s.parse::<RunState>()
                .map_err(|_| ConsoleError::BadRequest(format!("{s:?} is not a run state")))?,
        ),
    };
    let workflow = q.workflow.filter(|w| !w.is_empty());
    let mut filter = RunFilter::latest(500);
    filter.state = state;
    filter.workflow = workflow.clone();
    let runs = c.journal.runs().list(&filter).await?;
    let now = c.journal.now();
    let body = html! {
        form method="get" action="/" {
            label { "State " select name="state" {
                option value="" { "any" }
                @for st in RunState::ALL {
                    option value=(st.as_str()) selected[state == Some(st)] { (st.as_str()) }
                }
            } }
            label { "Workflow " input name="workflow" value=(workflow.clone().unwrap_or_default()); }
            button type="submit" { "Filter" }
        }
        @if runs.is_empty() {
            p { "No runs." }
        } @else {
            table {
                tr { th { "run" } th { "workflow" } th { "state" } th { "steps" } th { "done" }
                     th { "need a person" } th { "parked" } th { "in doubt" } th { "updated" }
                     th { "claimed by" } th { "error" } }
                @for r in &runs {
                    tr {
                        td { a href=(format!("/runs/{}", encode(&r.run))) { (r.run) } }
                        td { (r.workflow.clone().unwrap_or_default()) }
                        td.state.(r.state.as_str()) { (r.state.as_str()) }
                        td { (r.steps) } td { (r.done) } td { (r.needs_human) } td { (r.parked) }
                        td { (r.unknown) } td { (ago(now, r.updated_at)) }
                        td { (r.claimed_by.clone().unwrap_or_default()) }
                        td { (r.error.clone().unwrap_or_default()) }
                    }
                }
            }
        }
    };
    Ok(page("Runs", body))
}

/// `/stuck`: the steps waiting for a person, and the parked ones.
pub(crate) async fn stuck(State(c): State<Arc<Console>>) -> Result<Html<String>, ConsoleError> {
    let steps = c.journal.runs().stuck().await?;
    let now = c.journal.now();
    let body = html! {
        @if steps.is_empty() {
            p { "Nothing is stuck: no step waits for a person, none is parked." }
        } @else {
            table {
                tr { th { "run" } th { "step" } th { "call" } th { "tool" } th { "state" }
                     th { "waiting for" } th { "since" } }
                @for s in &steps {
                    tr {
                        td { a href=(format!("/runs/{}", encode(&s.id.run))) { (&*s.id.run) } }
                        td { (&*s.id.step) } td { (&*s.id.call) } td { (s.tool) }
                        td.state { (s.state.as_str()) }
                        td { (waiting(s, now)) }
                        td { (ago(now, s.updated_at)) }
                    }
                }
            }
        }
    };
    Ok(page("Needs a person", body))
}

fn waiting(s: &Step, now: DateTime<Utc>) -> String {
    match (&s.attention, s.parked_until) {
        (Some(why), _) => format!("a person: {why}"),
        (None, Some(at)) => format!("its time: wakes {}", when(now, at)),
        (None, None) => String::new(),
    }
}

/// `/runs/{run}`: the run's record, its steps with their history, its events and forks, and
/// (with actions allowed) the forms that act on it.
pub(crate) async fn run(
    State(c): State<Arc<Console>>,
    Path(run): Path<String>,
) -> Result<Html<String>, ConsoleError> {
    let j = &c.journal;
    // The run's five reads at once: the page waits for the slowest, not for their sum.
    let (record, steps, history, events, forks) = tokio::try_join!(
        j.runs().get(&run),
        j.runs().steps(&run),
        j.runs().history(&run),
        j.runs().events(&run),
        j.runs().forks(&run),
    )?;
    let Some(record) = record else {
        return Err(ConsoleError::NotFound(format!(
            "run {run} is not in the journal"
        )));
    };
    let now = j.now();
    let of =
        |s: &Step| -> Vec<&StepTransition> { history.iter().filter(|t| t.id == s.id).collect() };
    let acting = c.allow_actions;
    let body = html! {
        table {
            tr { th { "state" } td.state.(record.state.as_str()) { (record.state.as_str()) } }
            tr { th { "workflow" } td { (record.workflow.clone().unwrap_or_default()) } }
            tr { th { "input" } td { code { (record.input.clone().unwrap_or_default()) } } }
            tr { th { "output" } td { code { (record.output.clone().unwrap_or_default()) } } }
            tr { th { "error" } td { (record.error.clone().unwrap_or_default()) } }
            tr { th { "claimed by" } td { (record.claimed_by.clone().unwrap_or_default()) } }
            tr { th { "updated" } td { (ago(now, record.updated_at)) } }
            @if let Some(from) = &record.forked_from {
                tr { th { "forked from" } td {
                    a href=(format!("/runs/{}", encode(&from.run))) { (from.run) }
                    " at step " (from.step)
                } }
            }
            @for f in &forks {
                tr { th { "forked into" } td {
                    a href=(format!("/runs/{}", encode(&f.id))) { (f.id) }
                    " (" (f.state.as_str()) ")"
                } }
            }
        }
        h2 { "Steps" }
        @if steps.is_empty() { p { "No steps yet." } } @else {
            table {
                tr { th { "step" } th { "call" } th { "tool" } th { "state" } th { "attempts" }
                     th { "key" } th { "last error" } th { "time in each state" } th { "history" } }
                @for s in &steps {
                    @let h = of(s);
                    tr {
                        td { (&*s.id.step) } td { (&*s.id.call) } td { (s.tool) }
                        td.state { (s.state.as_str()) @if s.attention.is_some() { " (needs a person)" } }
                        td { (s.attempts) }
                        td { code title=(s.key) { (short_key(&s.key)) } }
                        td { (s.last_error.clone().or_else(|| s.attention.clone()).unwrap_or_default()) }
                        td { (times(&h, now)) }
                        td { @for t in &h {
                            div { (ago(now, t.at)) " → " (t.to.as_str()) " by " (t.actor)
                                @if let Some(r) = &t.reason { ": " (r) } }
                        } }
                    }
                }
            }
        }
        h2 { "Events" }
        ul { @for e in &events {
            li { (ago(now, e.at)) " " (e.action) " by " (e.actor)
                @if let Some(r) = &e.reason { ": " (r) } }
        } }
        @if acting {
            h2 { "Act" }
            (super::forms::forms(&c.token, &record, &steps))
        } @else {
            p { "Read-only: start the console with --allow-actions to act on runs." }
        }
    };
    Ok(page(&format!("Run {run}"), body))
}

fn times(history: &[&StepTransition], now: DateTime<Utc>) -> String {
    let owned: Vec<StepTransition> = history.iter().map(|t| (*t).clone()).collect();
    time_in_states(&owned, now)
        .into_iter()
        .map(|(st, ms)| match ms {
            Some(ms) => format!("{st} {}", human(ms)),
            None => st.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}
