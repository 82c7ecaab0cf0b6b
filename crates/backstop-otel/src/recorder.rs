//! A `metrics` recorder that records Backstop's `metrics` names as OpenTelemetry instruments,
//! under the names and attribute keys of the table in the crate's docs.

use crate::Telemetry;
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use opentelemetry::{KeyValue, metrics::Meter};
use std::{collections::HashMap, fmt, sync::Arc};

/// What a `metrics` name becomes.
#[derive(Clone, Copy)]
enum Kind {
    Counter(&'static str),
    Gauge(&'static str),
    Histogram(&'static str),
}

/// Backstop's `metrics` names and the OpenTelemetry instrument each is recorded as, with its
/// unit.
const NAMES: [(&str, Kind, &str); 17] = [
    (
        "backstop_retries_total",
        Kind::Counter("backstop.retries"),
        "{retry}",
    ),
    (
        "backstop_budget_refusals_total",
        Kind::Counter("backstop.budget.refusals"),
        "{refusal}",
    ),
    (
        "backstop_run_budget_refusals_total",
        Kind::Counter("backstop.run.budget.refusals"),
        "{refusal}",
    ),
    (
        "backstop_unknown_outcomes_total",
        Kind::Counter("backstop.unknown_outcomes"),
        "{call}",
    ),
    (
        "backstop_breaker_transitions_total",
        Kind::Counter("backstop.breaker.transitions"),
        "{transition}",
    ),
    (
        "backstop_breaker_rejections_total",
        Kind::Counter("backstop.breaker.refusals"),
        "{call}",
    ),
    (
        "backstop_hedges_total",
        Kind::Counter("backstop.hedges.sent"),
        "{hedge}",
    ),
    (
        "backstop_hedges_cancelled_total",
        Kind::Counter("backstop.hedges.cancelled"),
        "{hedge}",
    ),
    (
        "backstop_attempt_timeout_seconds",
        Kind::Gauge("backstop.attempt.timeout"),
        "s",
    ),
    (
        "backstop_replay_total",
        Kind::Counter("backstop.replay.requests"),
        "{request}",
    ),
    (
        "backstop_journal_transitions_total",
        Kind::Counter("backstop.journal.transitions"),
        "{transition}",
    ),
    (
        "backstop_journal_unknown_outcomes_total",
        Kind::Counter("backstop.journal.unknown_outcomes"),
        "{step}",
    ),
    (
        "backstop_journal_human_total",
        Kind::Counter("backstop.journal.needs_human"),
        "{step}",
    ),
    (
        "backstop_journal_duplicates_prevented_total",
        Kind::Counter("backstop.journal.duplicates_prevented"),
        "{step}",
    ),
    (
        "backstop_journal_reconciliation_seconds",
        Kind::Histogram("backstop.journal.reconciliation.duration"),
        "s",
    ),
    (
        "backstop_breaker_fleet_connected",
        Kind::Gauge("backstop.breaker.fleet.connected"),
        "1",
    ),
    (
        "backstop_run_retries_total",
        Kind::Counter("backstop.run.retries"),
        "{retry}",
    ),
];

/// The OpenTelemetry instrument names [`OtelRecorder`] records into, every one of them (and
/// those [`Telemetry`] records directly): for a dashboard's queries to be checked against.
pub const INSTRUMENTS: [&str; 27] = [
    "backstop.budget.remaining",
    "backstop.run.retries",
    "http.client.request.duration",
    "backstop.client.call.duration",
    "backstop.client.call.attempts",
    "grpc.client.call.retries",
    "grpc.client.call.transparent_retries",
    "grpc.client.call.hedges",
    "grpc.client.call.retry_delay",
    "backstop.throttled.calls",
    "backstop.breaker.state",
    "backstop.retries",
    "backstop.budget.refusals",
    "backstop.run.budget.refusals",
    "backstop.unknown_outcomes",
    "backstop.breaker.transitions",
    "backstop.breaker.refusals",
    "backstop.hedges.sent",
    "backstop.hedges.cancelled",
    "backstop.attempt.timeout",
    "backstop.replay.requests",
    "backstop.journal.transitions",
    "backstop.journal.unknown_outcomes",
    "backstop.journal.needs_human",
    "backstop.journal.duplicates_prevented",
    "backstop.journal.reconciliation.duration",
    "backstop.breaker.fleet.connected",
];

/// The attribute a `metrics` label of Backstop's becomes; `dependency` becomes two.
fn attributes(name: &str, key: &Key) -> Vec<KeyValue> {
    let mut attrs = Vec::with_capacity(4);
    for label in key.labels() {
        let value = label.value().to_owned();
        match label.key() {
            "dependency" => {
                attrs.push(KeyValue::new("backstop.dependency", value.clone()));
                attrs.push(KeyValue::new("server.address", value));
            }
            "tool" => attrs.push(KeyValue::new("backstop.tool", value)),
            "from" => attrs.push(KeyValue::new("backstop.breaker.from", value)),
            "to" if name.starts_with("backstop_journal") => {
                attrs.push(KeyValue::new("backstop.journal.state", value));
            }
            "to" => attrs.push(KeyValue::new("backstop.breaker.state", value)),
            "outcome" => attrs.push(KeyValue::new("backstop.replay.outcome", value)),
            "attempt" => attrs.push(KeyValue::new("backstop.attempt", value)),
            other => attrs.push(KeyValue::new(format!("backstop.{other}"), value)),
        }
    }
    attrs
}

enum Instrument {
    Counter(opentelemetry::metrics::Counter<u64>),
    Gauge(opentelemetry::metrics::Gauge<f64>),
    Histogram(opentelemetry::metrics::Histogram<f64>),
}

/// A `metrics` recorder that records Backstop's counts as the OpenTelemetry instruments of the
/// table in the crate's docs (names it does not know are not recorded). Install it as the
/// process's recorder (`metrics::set_global_recorder`), or beside another one with
/// `metrics-util`'s fan-out; the `metrics` feature of the Backstop crates must be on.
///
/// ```
/// use opentelemetry::metrics::MeterProvider;
///
/// let provider = opentelemetry_sdk::metrics::SdkMeterProvider::builder().build();
/// let telemetry = backstop_otel::Telemetry::new(&provider.meter("backstop"));
/// let recorder = backstop_otel::OtelRecorder::new(&telemetry);
/// let _local = metrics::set_default_local_recorder(&recorder);
/// ```
pub struct OtelRecorder {
    instruments: HashMap<&'static str, Instrument>,
    breaker_state: opentelemetry::metrics::Gauge<u64>,
}

impl fmt::Debug for OtelRecorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OtelRecorder")
            .field("names", &self.instruments.len())
            .finish()
    }
}

impl OtelRecorder {
    /// Makes every instrument of the table from `telemetry`'s meter.
    pub fn new(telemetry: &Telemetry) -> Self {
        let meter: &Meter = &telemetry.inner.meter;
        let instruments = NAMES
            .iter()
            .map(|&(name, kind, unit)| {
                let made = match kind {
                    Kind::Counter(n) => {
                        Instrument::Counter(meter.u64_counter(n).with_unit(unit).build())
                    }
                    Kind::Gauge(n) => Instrument::Gauge(meter.f64_gauge(n).with_unit(unit).build()),
                    Kind::Histogram(n) => {
                        Instrument::Histogram(meter.f64_histogram(n).with_unit(unit).build())
                    }
                };
                (name, made)
            })
            .collect();
        OtelRecorder {
            instruments,
            breaker_state: meter
                .u64_gauge("backstop.breaker.state")
                .with_unit("{state}")
                .with_description("A circuit's state: 0 closed, 1 half-open, 2 open, 3 isolated.")
                .build(),
        }
    }
}

struct Recorded<I> {
    instrument: I,
    attrs: Vec<KeyValue>,
    /// For the breaker's transitions: the state gauge, the state moved to, and the circuit's
    /// attributes.
    state: Option<(opentelemetry::metrics::Gauge<u64>, u64, Vec<KeyValue>)>,
}

impl metrics::CounterFn for Recorded<opentelemetry::metrics::Counter<u64>> {
    fn increment(&self, value: u64) {
        self.instrument.add(value, &self.attrs);
        if let Some((gauge, state, attrs)) = &self.state {
            gauge.record(*state, attrs);
        }
    }
    fn absolute(&self, _value: u64) {}
}

impl metrics::GaugeFn for Recorded<opentelemetry::metrics::Gauge<f64>> {
    fn increment(&self, _value: f64) {}
    fn decrement(&self, _value: f64) {}
    fn set(&self, value: f64) {
        self.instrument.record(value, &self.attrs);
    }
}

impl metrics::HistogramFn for Recorded<opentelemetry::metrics::Histogram<f64>> {
    fn record(&self, value: f64) {
        self.instrument.record(value, &self.attrs);
    }
}

fn state_value(key: &Key) -> Option<u64> {
    let to = key.labels().find(|l| l.key() == "to")?;
    Some(match to.value() {
        "closed" => 0,
        "half_open" => 1,
        "open" => 2,
        _ => 3,
    })
}

impl Recorder for OtelRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        match self.instruments.get(key.name()) {
            Some(Instrument::Counter(c)) => {
                let attrs = attributes(key.name(), key);
                let state = (key.name() == "backstop_breaker_transitions_total")
                    .then(|| state_value(key))
                    .flatten()
                    .map(|s| {
                        let circuit = attrs
                            .iter()
                            .filter(|kv| {
                                matches!(kv.key.as_str(), "backstop.dependency" | "server.address")
                            })
                            .cloned()
                            .collect();
                        (self.breaker_state.clone(), s, circuit)
                    });
                Counter::from_arc(Arc::new(Recorded {
                    instrument: c.clone(),
                    attrs,
                    state,
                }))
            }
            _ => Counter::noop(),
        }
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        match self.instruments.get(key.name()) {
            Some(Instrument::Gauge(g)) => Gauge::from_arc(Arc::new(Recorded {
                instrument: g.clone(),
                attrs: attributes(key.name(), key),
                state: None,
            })),
            _ => Gauge::noop(),
        }
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        match self.instruments.get(key.name()) {
            Some(Instrument::Histogram(h)) => Histogram::from_arc(Arc::new(Recorded {
                instrument: h.clone(),
                attrs: attributes(key.name(), key),
                state: None,
            })),
            _ => Histogram::noop(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::metrics::MeterProvider;
    use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};

    /// Every `metrics` name of the table arrives under its OpenTelemetry name, with the
    /// labels as the table's attributes; a name the table does not know is not recorded.
    #[test]
    fn every_metrics_name_arrives_under_its_opentelemetry_name() {
        let exporter = InMemoryMetricExporter::default();
        let provider = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(exporter.clone()).build())
            .build();
        let telemetry = Telemetry::new(&provider.meter("backstop"));
        let recorder = OtelRecorder::new(&telemetry);
        metrics::with_local_recorder(&recorder, || {
            for (name, kind, _) in NAMES {
                let labels = [
                    ("dependency", "ledger-api"),
                    ("to", "open"),
                    ("tool", "mailer"),
                ];
                match kind {
                    Kind::Counter(_) => metrics::counter!(name, &labels).increment(2),
                    Kind::Gauge(_) => metrics::gauge!(name, &labels).set(1.5),
                    Kind::Histogram(_) => metrics::histogram!(name, &labels).record(0.25),
                }
            }
            metrics::counter!("not_backstops_own").increment(1);
        });
        provider.force_flush().unwrap();
        let mut seen: Vec<(String, Vec<String>)> = Vec::new();
        for rm in exporter.get_finished_metrics().unwrap() {
            for sm in rm.scope_metrics() {
                for m in sm.metrics() {
                    let keys = format!("{:?}", m.data());
                    seen.push((m.name().to_owned(), vec![keys]));
                }
            }
        }
        for (name, kind, _) in NAMES {
            let otel = match kind {
                Kind::Counter(n) | Kind::Gauge(n) | Kind::Histogram(n) => n,
            };
            let (_, data) = seen
                .iter()
                .find(|(n, _)| n == otel)
                .unwrap_or_else(|| panic!("{name} did not arrive as {otel}"));
            let data = &data[0];
            assert!(data.contains("backstop.dependency"), "{otel}: {data}");
            assert!(data.contains("server.address"), "{otel}: {data}");
            let state = if name.starts_with("backstop_journal") {
                "backstop.journal.state"
            } else {
                "backstop.breaker.state"
            };
            assert!(data.contains(state), "{otel}: {data}");
            assert!(data.contains("backstop.tool"), "{otel}: {data}");
        }
        // The breaker's state gauge is set by its transitions: open is 2.
        let (_, state) = seen
            .iter()
            .find(|(n, _)| n == "backstop.breaker.state")
            .expect("the state gauge");
        assert!(state[0].contains("value: 2"), "{state:?}");
        assert!(!seen.iter().any(|(n, _)| n.contains("not_backstops_own")));
    }
}
