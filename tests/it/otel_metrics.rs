//! The stack's telemetry in OpenTelemetry's words, read back through the SDK's in-memory
//! exporter: one call with two retries gives the instruments and attributes the table in
//! `backstop::otel` says, for HTTP and for gRPC; the counts kept through `metrics` arrive
//! under their OpenTelemetry names through `OtelRecorder`.

use backstop::{
    Backstop, ErrorKind,
    backoff::{Backoff, RngSource},
    budget::{AdaptiveThrottle, ThrottleConfig},
    otel::{OtelRecorder, Telemetry},
};
use opentelemetry::{KeyValue, metrics::MeterProvider};
use opentelemetry_sdk::metrics::{
    InMemoryMetricExporter, PeriodicReader, SdkMeterProvider,
    data::{AggregatedMetrics, MetricData},
};
use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};
use tower::{Layer, ServiceExt, service_fn};

/// One data point: its attributes (sorted), and its count (histograms) or value (sums, gauges).
type Point = (BTreeMap<String, String>, f64);

struct Exported {
    exporter: InMemoryMetricExporter,
    provider: SdkMeterProvider,
}

impl Exported {
    fn new() -> Self {
        let exporter = InMemoryMetricExporter::default();
        let provider = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(exporter.clone()).build())
            .build();
        Exported { exporter, provider }
    }

    fn telemetry(&self) -> Telemetry {
        Telemetry::new(&self.provider.meter("backstop"))
    }

    /// Every instrument's points, by name (histograms: each point's count).
    fn points(&self) -> BTreeMap<String, Vec<Point>> {
        self.provider.force_flush().unwrap();
        let mut out: BTreeMap<String, Vec<Point>> = BTreeMap::new();
        for rm in self.exporter.get_finished_metrics().unwrap() {
            for sm in rm.scope_metrics() {
                for m in sm.metrics() {
                    assert!(
                        backstop::otel::INSTRUMENTS.contains(&m.name()),
                        "{} is emitted but not listed",
                        m.name()
                    );
                    let attrs = |kvs: &mut dyn Iterator<Item = &KeyValue>| {
                        kvs.map(|kv| (kv.key.to_string(), kv.value.to_string()))
                            .collect::<BTreeMap<_, _>>()
                    };
                    let mut points: Vec<Point> = Vec::new();
                    match m.data() {
                        AggregatedMetrics::F64(MetricData::Histogram(h)) => {
                            for p in h.data_points() {
                                points.push((attrs(&mut p.attributes()), p.count() as f64));
                            }
                        }
                        AggregatedMetrics::U64(MetricData::Histogram(h)) => {
                            for p in h.data_points() {
                                let mut a = attrs(&mut p.attributes());
                                a.insert("(sum)".into(), p.sum().to_string());
                                points.push((a, p.count() as f64));
                            }
                        }
                        AggregatedMetrics::U64(MetricData::Sum(s)) => {
                            for p in s.data_points() {
                                points.push((attrs(&mut p.attributes()), p.value() as f64));
                            }
                        }
                        AggregatedMetrics::U64(MetricData::Gauge(g)) => {
                            for p in g.data_points() {
                                points.push((attrs(&mut p.attributes()), p.value() as f64));
                            }
                        }
                        AggregatedMetrics::F64(MetricData::Gauge(g)) => {
                            for p in g.data_points() {
                                points.push((attrs(&mut p.attributes()), p.value()));
                            }
                        }
                        other => panic!("{}: unexpected data {other:?}", m.name()),
                    }
                    out.entry(m.name().to_owned()).or_default().extend(points);
                }
            }
        }
        out
    }
}

fn has(point: &Point, want: &[(&str, &str)]) -> bool {
    want.iter()
        .all(|(k, v)| point.0.get(*k).map(String::as_str) == Some(*v))
}

/// A GET whose first two answers are 503s: three attempts, one call.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn one_call_with_two_retries_gives_the_instruments_the_table_names() {
    let exported = Exported::new();
    let telemetry = exported.telemetry();
    let recorder = OtelRecorder::new(&telemetry);
    let _metrics = metrics::set_default_local_recorder(&recorder);

    let n = Arc::new(AtomicU32::new(0));
    let flaky = service_fn(move |_req: http::Request<String>| {
        let status = if n.fetch_add(1, Ordering::SeqCst) < 2 {
            503
        } else {
            200
        };
        async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok::<_, std::io::Error>(http::Response::builder().status(status).body(()).unwrap())
        }
    });
    let stack = Backstop::http("otel-rates-api")
        .backoff(Backoff::constant(Duration::from_millis(100)))
        .rng(RngSource::seeded(3))
        .no_breaker()
        .no_budget()
        .telemetry(telemetry)
        .build()
        .unwrap();
    let req = http::Request::get("http://rates.otel.test:8080/today")
        .body(String::new())
        .unwrap();
    let res = stack.layer(flaky).oneshot(req).await.unwrap();
    assert_eq!(res.status(), 200);

    let points = exported.points();
    let attempts = &points["http.client.request.duration"];
    assert_eq!(attempts.len(), 3, "one point per attempt: {attempts:?}");
    // The first attempt was not resent: the conventions leave the attribute off it, as the
    // attempt's span does.
    for (resend, status, error) in [
        (None, "503", Some("503")),
        (Some("1"), "503", Some("503")),
        (Some("2"), "200", None),
    ] {
        let p = attempts
            .iter()
            .find(|p| p.0.get("http.request.resend_count").map(String::as_str) == resend)
            .unwrap_or_else(|| panic!("attempt with resend count {resend:?}: {attempts:?}"));
        assert!(
            has(
                p,
                &[
                    ("http.request.method", "GET"),
                    ("server.address", "rates.otel.test"),
                    ("server.port", "8080"),
                    ("url.scheme", "http"),
                    ("http.response.status_code", status),
                    ("backstop.dependency", "otel-rates-api"),
                ]
            ),
            "{p:?}"
        );
        assert_eq!(p.0.get("error.type").map(String::as_str), error, "{p:?}");
        assert_eq!(p.1, 1.0);
    }
    let calls = &points["backstop.client.call.duration"];
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert!(
        has(
            &calls[0],
            &[
                ("backstop.dependency", "otel-rates-api"),
                ("server.address", "otel-rates-api"),
                ("backstop.outcome", "completed"),
            ]
        ) && !calls[0].0.contains_key("error.type"),
        "{calls:?}"
    );
    let per_call = &points["backstop.client.call.attempts"];
    assert_eq!(per_call[0].0["(sum)"], "3", "{per_call:?}");
    // Through `metrics`: the retries under their OpenTelemetry name.
    let retries = &points["backstop.retries"];
    assert!(
        retries
            .iter()
            .any(|p| has(p, &[("backstop.dependency", "otel-rates-api")]) && p.1 == 2.0),
        "{retries:?}"
    );
    assert!(
        !points.contains_key("grpc.client.call.retries"),
        "an HTTP stack"
    );
}

/// A dependency that sheds every request (503) behind adaptive throttling: once the throttle
/// has learned that, it ends calls itself, nothing sent, and `backstop.throttled.calls` counts
/// exactly those calls, under the dependency's name; calls the dependency answered are not in it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn calls_ended_by_adaptive_throttling_are_counted_as_throttled() {
    let exported = Exported::new();
    let shedding = service_fn(|_req: http::Request<String>| async {
        Ok::<_, std::io::Error>(http::Response::builder().status(503).body(()).unwrap())
    });
    let throttle = AdaptiveThrottle::new(ThrottleConfig::default(), 11).unwrap();
    let stack = Backstop::http("otel-shedding-api")
        .max_attempts(1)
        .no_breaker()
        .no_budget()
        .adaptive_throttle(throttle)
        .telemetry(exported.telemetry())
        .build()
        .unwrap();
    let svc = stack.layer(shedding);
    let (mut throttled, mut answered) = (0, 0);
    for _ in 0..200 {
        let req = http::Request::get("http://shedding.otel.test/items")
            .body(String::new())
            .unwrap();
        match svc.clone().oneshot(req).await {
            Ok(res) => {
                assert_eq!(res.status(), 503);
                answered += 1;
            }
            Err(err) => {
                assert_eq!(err.kind(), ErrorKind::Throttled, "{err}");
                throttled += 1;
            }
        }
        tokio::time::advance(Duration::from_millis(10)).await;
    }
    assert!(
        throttled > 50 && answered > 0,
        "{throttled} throttled, {answered} answered"
    );

    let points = exported.points();
    let counted = &points["backstop.throttled.calls"];
    assert_eq!(counted.len(), 1, "{counted:?}");
    assert!(
        has(
            &counted[0],
            &[
                ("backstop.dependency", "otel-shedding-api"),
                ("server.address", "otel-shedding-api"),
            ]
        ),
        "{counted:?}"
    );
    assert_eq!(counted[0].1, f64::from(throttled), "{counted:?}");
}

/// A gRPC call refused twice before it was sent, answered `UNAVAILABLE`, then `OK`: gRPC's
/// A96 per-call instruments.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_grpc_call_with_three_retries_gives_the_a96_instruments() {
    let exported = Exported::new();
    let n = Arc::new(AtomicU32::new(0));
    // The first two attempts never leave the client (refused connections): the retries after
    // them are transparent; the third is answered `UNAVAILABLE`, the fourth `OK`.
    let flaky = service_fn(move |_req: http::Request<tonic::body::Body>| {
        let n = n.fetch_add(1, Ordering::SeqCst);
        async move {
            if n < 2 {
                return Err(tower::BoxError::from(std::io::Error::from(
                    std::io::ErrorKind::ConnectionRefused,
                )));
            }
            let code = if n == 2 { "14" } else { "0" };
            let mut res = http::Response::new(tonic::body::Body::empty());
            res.headers_mut()
                .insert("grpc-status", code.parse().unwrap());
            Ok(res)
        }
    });
    let stack = Backstop::grpc("otel-quotes-grpc")
        .honours_keys()
        .max_attempts(4)
        .backoff(Backoff::constant(Duration::from_millis(100)))
        .rng(RngSource::seeded(3))
        .no_breaker()
        .no_budget()
        .telemetry(exported.telemetry())
        .build()
        .unwrap();
    let req = http::Request::post("http://quotes.otel.test:50051/quotes.v1.Quotes/Get")
        .body(tonic::body::Body::empty())
        .unwrap();
    let res = stack.layer(flaky).oneshot(req).await.unwrap();
    assert_eq!(res.headers()["grpc-status"], "0");

    let points = exported.points();
    let grpc = [
        ("grpc.method", "/quotes.v1.Quotes/Get"),
        ("grpc.target", "quotes.otel.test:50051"),
    ];
    for (name, sum) in [
        ("grpc.client.call.retries", "3"),
        ("grpc.client.call.transparent_retries", "2"),
        ("grpc.client.call.hedges", "0"),
    ] {
        let p = &points[name];
        assert!(
            p.len() == 1 && has(&p[0], &grpc) && p[0].0["(sum)"] == sum,
            "{name}: {p:?}"
        );
    }
    let delay = &points["grpc.client.call.retry_delay"];
    assert!(delay.len() == 1 && has(&delay[0], &grpc), "{delay:?}");
    assert_eq!(points["http.client.request.duration"].len(), 4);
}

/// A call that fails for good: its kind of error and its outcome on the call's instrument; a
/// budget refusal and a breaker's transitions arrive through `metrics` under their names.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_failed_call_names_its_error_and_the_breaker_its_state() {
    use backstop::breaker::{Breaker, BreakerConfig};
    let exported = Exported::new();
    let telemetry = exported.telemetry();
    let recorder = OtelRecorder::new(&telemetry);
    let _metrics = metrics::set_default_local_recorder(&recorder);
    let down = service_fn(|_req: http::Request<String>| async {
        Err::<http::Response<()>, _>(std::io::Error::from(std::io::ErrorKind::ConnectionReset))
    });
    let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(2)).unwrap();
    let stack = Backstop::http("otel-ledger-api")
        .max_attempts(2)
        .backoff(Backoff::constant(Duration::from_millis(10)))
        .rng(RngSource::seeded(3))
        .breaker(breaker)
        .no_budget()
        .telemetry(telemetry)
        .build()
        .unwrap()
        .layer(down);
    let req = http::Request::get("http://ledger.otel.test/balance")
        .body(String::new())
        .unwrap();
    let err = stack.clone().oneshot(req).await.unwrap_err();
    let points = exported.points();
    let calls = &points["backstop.client.call.duration"];
    assert!(
        calls.iter().any(|p| has(
            p,
            &[
                ("backstop.dependency", "otel-ledger-api"),
                ("error.type", err.kind().as_str()),
                ("backstop.outcome", err.outcome().as_str()),
            ]
        )),
        "{calls:?}"
    );
    let attempts = &points["http.client.request.duration"];
    assert!(
        attempts
            .iter()
            .any(|p| has(p, &[("error.type", "ConnectionReset")])),
        "{attempts:?}"
    );
    let transitions = &points["backstop.breaker.transitions"];
    assert!(
        transitions.iter().any(|p| has(
            p,
            &[
                ("backstop.dependency", "otel-ledger-api"),
                ("backstop.breaker.state", "open")
            ]
        )),
        "{transitions:?}"
    );
    let state = &points["backstop.breaker.state"];
    assert!(
        state
            .iter()
            .any(|p| has(p, &[("backstop.dependency", "otel-ledger-api")]) && p.1 == 2.0),
        "open is 2: {state:?}"
    );
}

/// The guide's telemetry table is the crate's: the same rows, so every instrument is in it.
#[test]
fn the_guide_shows_the_telemetry_table() {
    let readme = include_str!("../../docs/guide/08-telemetry.md");
    let docs = include_str!("../../crates/backstop-otel/src/lib.rs");
    let rows = docs.lines().filter_map(|l| l.strip_prefix("//! "));
    for row in rows.filter(|r| r.starts_with("| `")) {
        assert!(readme.contains(row), "the guide lacks the row {row}");
    }
    for name in backstop::otel::INSTRUMENTS {
        assert!(readme.contains(&format!("| `{name}` |")), "{name}");
    }
}
