//! Backstop's telemetry in OpenTelemetry's words, on the `opentelemetry` API: no exporter is
//! chosen for you, the instruments come from the [`Meter`](opentelemetry::metrics::Meter) you
//! give ([`Telemetry::new`]).
//!
//! Three sources, one set of names:
//! - **Each attempt** ([`AttemptMetricsLayer`], which the composed stack puts between its retry
//!   layer and the client): `http.client.request.duration` with the HTTP semantic
//!   conventions' attributes, `http.request.resend_count` among them, and the same attributes
//!   on the attempt's span (a child of the call's span).
//! - **Each call** ([`Telemetry::record_call`], from the composed stack): Backstop's own
//!   per-call duration and attempts, and for gRPC the per-call metrics of gRPC's A96 proposal.
//! - **Everything else Backstop counts** (budget refusals, breaker transitions, hedges, replays,
//!   journal steps), which the crates count through the `metrics` facade: [`OtelRecorder`] is a
//!   `metrics` recorder that records each of those under its OpenTelemetry name below.
//!
//! | OpenTelemetry instrument | kind, unit | attributes | `metrics` name it mirrors |
//! |---|---|---|---|
//! | `http.client.request.duration` | histogram, s | `http.request.method`, `server.address`, `server.port`, `url.scheme`, `http.response.status_code`, `error.type`, `http.request.resend_count` (on resends), `backstop.dependency` | `backstop_attempts_total` (its count) |
//! | `backstop.client.call.duration` | histogram, s | `backstop.dependency`, `server.address`, `backstop.outcome`, `error.type` | `backstop_calls_total` (its count) |
//! | `backstop.client.call.attempts` | histogram, {attempt} | `backstop.dependency`, `server.address`, `backstop.outcome` | `backstop_success_after_attempt_total` |
//! | `grpc.client.call.retries` | histogram, {retry} | `grpc.method`, `grpc.target` | `backstop_retries_total` |
//! | `grpc.client.call.transparent_retries` | histogram, {transparent_retry} | `grpc.method`, `grpc.target` | (retries after an attempt that was not sent) |
//! | `grpc.client.call.hedges` | histogram, {hedge} | `grpc.method`, `grpc.target` | (0: a hedged copy is a call of its own) |
//! | `grpc.client.call.retry_delay` | histogram, s | `grpc.method`, `grpc.target` | (the waits between attempts) |
//! | `backstop.retries` | counter, {retry} | `backstop.dependency`, `server.address` | `backstop_retries_total` |
//! | `backstop.run.retries` | counter, {retry} | `backstop.dependency`, `server.address` | `backstop_run_retries_total` |
//! | `backstop.budget.remaining` | gauge (observed), {retry} | `backstop.dependency`, `server.address` | (the budget's allowance left in its window) |
//! | `backstop.budget.refusals` | counter, {refusal} | `backstop.dependency`, `server.address` | `backstop_budget_refusals_total` |
//! | `backstop.run.budget.refusals` | counter, {refusal} | `backstop.dependency`, `server.address` | `backstop_run_budget_refusals_total` |
//! | `backstop.unknown_outcomes` | counter, {call} | `backstop.dependency`, `server.address` | `backstop_unknown_outcomes_total` |
//! | `backstop.breaker.transitions` | counter, {transition} | `backstop.dependency`, `server.address`, `backstop.breaker.from`, `backstop.breaker.state` | `backstop_breaker_transitions_total` |
//! | `backstop.breaker.state` | gauge, {state} (0 closed, 1 half-open, 2 open, 3 isolated) | `backstop.dependency`, `server.address` | (set at each transition) |
//! | `backstop.breaker.fleet.connected` | gauge, 1 | | `backstop_breaker_fleet_connected` |
//! | `backstop.breaker.refusals` | counter, {call} | `backstop.dependency`, `server.address` | `backstop_breaker_rejections_total` |
//! | `backstop.throttled.calls` | counter, {call} | `backstop.dependency`, `server.address` | (calls ended by adaptive throttling) |
//! | `backstop.hedges.sent` | counter, {hedge} | `backstop.dependency`, `server.address` | `backstop_hedges_total` |
//! | `backstop.hedges.cancelled` | counter, {hedge} | `backstop.dependency`, `server.address` | `backstop_hedges_cancelled_total` |
//! | `backstop.attempt.timeout` | gauge, s | `backstop.dependency`, `server.address` | `backstop_attempt_timeout_seconds` |
//! | `backstop.replay.requests` | counter, {request} | `backstop.replay.outcome` | `backstop_replay_total` |
//! | `backstop.journal.transitions` | counter, {transition} | `backstop.tool`, `backstop.journal.state` | `backstop_journal_transitions_total` |
//! | `backstop.journal.unknown_outcomes` | counter, {step} | `backstop.tool` | `backstop_journal_unknown_outcomes_total` |
//! | `backstop.journal.needs_human` | counter, {step} | `backstop.tool` | `backstop_journal_human_total` |
//! | `backstop.journal.duplicates_prevented` | counter, {step} | `backstop.tool` | `backstop_journal_duplicates_prevented_total` |
//! | `backstop.journal.reconciliation.duration` | histogram, s | `backstop.tool` | `backstop_journal_reconciliation_seconds` |
//!
//! `backstop.dependency` is the stack's dependency name (capped at
//! [`Dependency::MAX_METRIC_LABELS`](backstop_core::Dependency::MAX_METRIC_LABELS) names a
//! process); on Backstop's own instruments `server.address` is that name too, since no host
//! is known there, while `http.client.request.duration` has the request's own host and port.
//! `error.type` is the status code for an HTTP error status, the I/O error's kind for a
//! transport error, `timeout` for an attempt cut by its limit, `cancelled` for one dropped
//! before it (a hedge that lost, a caller that gave up), and Backstop's error kind on a call.
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod attempt;
mod record;

mod recorder;
mod telemetry;

pub mod future;

pub use attempt::{AttemptMetrics, AttemptMetricsLayer};
pub use recorder::{INSTRUMENTS, OtelRecorder};
pub use telemetry::{CallRecord, Telemetry};

#[cfg(test)]
mod tests {
    /// Every instrument the crate makes is in the table of its docs, and in [`INSTRUMENTS`].
    #[test]
    fn the_table_names_every_instrument() {
        let docs = include_str!("lib.rs");
        let rows: Vec<&str> = docs
            .lines()
            .filter_map(|l| l.strip_prefix("//! | `"))
            .filter_map(|l| l.split('`').next())
            .collect();
        let mut listed: Vec<&str> = crate::INSTRUMENTS.to_vec();
        listed.sort_unstable();
        let mut table = rows.clone();
        table.sort_unstable();
        assert_eq!(table, listed, "the docs' table and INSTRUMENTS");
        let sources = [include_str!("telemetry.rs"), include_str!("recorder.rs")].concat();
        for name in crate::INSTRUMENTS {
            let made = sources.matches(&format!("\"{name}\"")).count();
            assert!(made >= 2, "{name} is listed and made ({made} mentions)");
        }
    }
}

#[cfg(test)]
mod dashboard {
    /// The forms Prometheus gives an instrument's name: dots to underscores, the unit's suffix
    /// (`_seconds`), `_total` for a counter, `_bucket`, `_count`, `_sum` for a histogram.
    fn prometheus_forms(instrument: &str) -> Vec<String> {
        let base = instrument.replace('.', "_");
        let mut forms = Vec::new();
        for stem in [base.clone(), format!("{base}_seconds")] {
            for suffix in ["", "_total", "_bucket", "_count", "_sum"] {
                forms.push(format!("{stem}{suffix}"));
            }
        }
        forms
    }

    /// Every metric a query of `grafana/backstop.json` names is an instrument the crate makes.
    #[test]
    fn every_query_names_an_instrument_the_code_emits() {
        let dashboard: serde_json::Value =
            serde_json::from_str(include_str!("../grafana/backstop.json")).unwrap();
        let known: Vec<String> = crate::INSTRUMENTS
            .iter()
            .flat_map(|i| prometheus_forms(i))
            .collect();
        let mut queries = 0;
        let mut named = std::collections::BTreeSet::new();
        for panel in dashboard["panels"].as_array().unwrap() {
            for target in panel["targets"].as_array().unwrap() {
                let expr = target["expr"].as_str().unwrap();
                queries += 1;
                let metrics: Vec<&str> = expr
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .filter(|t| {
                        t.starts_with("backstop_")
                            || t.starts_with("http_client_")
                            || t.starts_with("grpc_client_")
                    })
                    .filter(|t| *t != "backstop_dependency" && *t != "backstop_tool")
                    .collect();
                assert!(!metrics.is_empty(), "a query that names no metric: {expr}");
                for m in metrics {
                    assert!(
                        known.iter().any(|k| k == m),
                        "{m} in {expr:?} is no instrument of the crate's"
                    );
                    named.insert(m.to_owned());
                }
            }
        }
        assert!(queries >= 6, "{queries} queries");
        // What the dashboard promises: calls and attempts, the budget, the breaker, latency,
        // unknown outcomes, steps needing a person.
        for needed in [
            "backstop_client_call_duration_seconds_count",
            "http_client_request_duration_seconds_count",
            "backstop_budget_remaining",
            "backstop_breaker_state",
            "backstop_client_call_duration_seconds_bucket",
            "backstop_unknown_outcomes_total",
            "backstop_journal_needs_human_total",
        ] {
            assert!(named.contains(needed), "no panel reads {needed}");
        }
    }
}
