//! What the commands print: tables for people, JSON for scripts, times in words.

use backstop_journal::{RunEvent, RunRecord, Step, StepTransition};
use chrono::{DateTime, Utc};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;
use std::collections::BTreeMap;

pub(crate) fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(header.to_vec());
    t
}

/// `value` as pretty JSON: the shape its type serializes to, the same wherever it is shown.
pub(crate) fn print_json<T: Serialize + ?Sized>(value: &T) {
    println!("{}", serde_json::to_string_pretty(value).expect("JSON"));
}

/// What `show --json` prints: the run's record, its events, the runs forked from it, and its
/// steps, each with its history and the time it spent in each state.
#[derive(Serialize)]
pub(crate) struct RunShown<'a> {
    pub(crate) run: &'a RunRecord,
    pub(crate) events: &'a [RunEvent],
    pub(crate) forks: &'a [RunRecord],
    pub(crate) steps: Vec<StepShown<'a>>,
}

/// One step in [`RunShown`].
#[derive(Serialize)]
pub(crate) struct StepShown<'a> {
    #[serde(flatten)]
    pub(crate) step: &'a Step,
    pub(crate) history: &'a [StepTransition],
    /// Milliseconds in each state (`null`: the final state, not waiting).
    pub(crate) time_in_state_ms: BTreeMap<&'static str, Option<i64>>,
}

/// How long the step spent in each state it passed through, summed, in order of first visit.
/// The state it is in now counts until now, unless it is final (a step over is not "waiting").
pub(crate) fn time_in_states(
    history: &[StepTransition],
    now: DateTime<Utc>,
) -> Vec<(&'static str, Option<i64>)> {
    let mut out: Vec<(&'static str, Option<i64>)> = Vec::new();
    for (i, t) in history.iter().enumerate() {
        let spent = match history.get(i + 1) {
            Some(next) => Some(millis_between(t.at, next.at)),
            None if t.to.is_final() => None,
            None => Some(millis_between(t.at, now)),
        };
        match out.iter_mut().find(|(s, _)| *s == t.to.as_str()) {
            Some((_, ms)) => *ms = Some(ms.unwrap_or(0) + spent.unwrap_or(0)),
            None => out.push((t.to.as_str(), spent)),
        }
    }
    out
}

/// Milliseconds from `from` to `to`, none when `to` is earlier.
fn millis_between(from: DateTime<Utc>, to: DateTime<Utc>) -> i64 {
    (to - from).num_milliseconds().max(0)
}

pub(crate) fn human(ms: i64) -> String {
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

pub(crate) fn ago(now: DateTime<Utc>, at: DateTime<Utc>) -> String {
    format!("{} ago", human(millis_between(at, now)))
}

pub(crate) fn when(now: DateTime<Utc>, at: DateTime<Utc>) -> String {
    // The HTTP date format (RFC 9110's IMF-fixdate), for any time a clock can write.
    let date = at.format("%a, %d %b %Y %H:%M:%S GMT");
    if at > now {
        format!("in {} ({date})", human(millis_between(now, at)))
    } else {
        format!("now (due {date})")
    }
}

pub(crate) fn short_key(key: &str) -> String {
    if key.len() > 16 {
        format!("{}…", &key[..16])
    } else {
        key.to_owned()
    }
}
