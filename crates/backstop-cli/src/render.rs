//! What the commands print: tables for people, JSON for scripts, times in words.

use backstop_journal::{RunEvent, RunRecord, RunSummary, Step, StepTransition};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use serde_json::{Value, json};
use std::time::{Duration, UNIX_EPOCH};

pub(crate) fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(header.to_vec());
    t
}

pub(crate) fn print_json(v: &Value) {
    println!("{}", serde_json::to_string_pretty(v).expect("JSON"));
}

pub(crate) fn run_json(r: &RunSummary) -> Value {
    json!({
        "run": r.run, "workflow": r.workflow, "state": r.state.as_str(), "steps": r.steps,
        "done": r.done, "needs_human": r.needs_human, "parked": r.parked, "unknown": r.unknown,
        "updated_ms": r.updated_ms, "claimed_by": r.claimed_by, "wake_ms": r.wake_ms,
        "error": r.error,
    })
}

pub(crate) fn run_record_json(r: &RunRecord) -> Value {
    json!({
        "run": r.id, "workflow": r.workflow, "input": r.input, "state": r.state.as_str(),
        "output": r.output, "error": r.error, "claimed_by": r.claimed_by,
        "claim_until_ms": r.claim_until, "wake_ms": r.wake_ms, "created_ms": r.created_ms,
        "updated_ms": r.updated_ms,
        "forked_from": r.forked_from.as_ref().map(|f| json!({ "run": f.run, "step": f.step })),
    })
}

pub(crate) fn event_json(e: &RunEvent) -> Value {
    json!({ "at_ms": e.at_ms, "actor": e.actor, "action": e.action, "reason": e.reason })
}

pub(crate) fn step_json(s: &Step) -> Value {
    json!({
        "run": &*s.id.run, "step": &*s.id.step, "call": &*s.id.call, "tool": s.tool,
        "kind": s.kind.as_str(), "state": s.state.as_str(), "outcome": s.state.outcome().as_str(),
        "attempts": s.attempts, "key": s.key, "last_error": s.last_error, "result": s.result,
        "provider_ref": s.provider_ref, "park_until_ms": s.park_until, "needs_human": s.attention,
        "created_ms": s.created_ms, "updated_ms": s.updated_ms, "sent_ms": s.sent_ms,
    })
}

pub(crate) fn transition_json(t: &StepTransition) -> Value {
    json!({
        "from": t.from.map(|s| s.as_str()), "to": t.to.as_str(), "at_ms": t.at_ms,
        "attempts": t.attempts, "error": t.error, "actor": t.actor, "reason": t.reason,
    })
}

/// How long the step spent in each state it passed through, summed, in order of first visit.
/// The state it is in now counts until now, unless it is final (a step over is not "waiting").
pub(crate) fn time_in_states(
    history: &[StepTransition],
    now: i64,
) -> Vec<(&'static str, Option<i64>)> {
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

pub(crate) fn ago(now: i64, at: i64) -> String {
    format!("{} ago", human(now - at))
}

pub(crate) fn when(now: i64, at: i64) -> String {
    let date = UNIX_EPOCH + Duration::from_millis(u64::try_from(at).unwrap_or(0));
    if at > now {
        format!("in {} ({})", human(at - now), httpdate::fmt_http_date(date))
    } else {
        format!("now (due {})", httpdate::fmt_http_date(date))
    }
}

pub(crate) fn short_key(key: &str) -> String {
    if key.len() > 16 {
        format!("{}…", &key[..16])
    } else {
        key.to_owned()
    }
}
