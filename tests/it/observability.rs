//! What the stack counts: metrics that count logical calls and attempts apart, per dependency.

use crate::common;

use backstop::{
    Backstop,
    backoff::RngSource,
    breaker::{Breaker, BreakerConfig},
    budget::Budget,
};
use http::{Request, Response};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use std::{
    collections::HashMap,
    io,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};
use tower::{Layer, ServiceExt, service_fn};

/// Counters by name and sorted labels.
#[derive(Clone, Default)]
struct Counters(Arc<Mutex<HashMap<String, Arc<AtomicU64>>>>);

impl Counters {
    fn get(&self, name: &str) -> u64 {
        self.0
            .lock()
            .unwrap()
            .get(name)
            .map_or(0, |c| c.load(Ordering::SeqCst))
    }
}

impl Recorder for Counters {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let mut labels: Vec<_> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        Counter::from_arc(self.0.lock().unwrap().entry(name).or_default().clone())
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn calls_attempts_retries_and_successes_are_counted_apart() {
    let counters = Counters::default();
    let _metrics = metrics::set_default_local_recorder(&counters);

    common::label_purchase_retried_once("observability-labels-api").await;

    assert_eq!(
        counters.get("backstop_calls_total{dependency=observability-labels-api}"),
        1
    );
    assert_eq!(
        counters.get("backstop_attempts_total{dependency=observability-labels-api}"),
        2
    );
    assert_eq!(
        counters.get("backstop_retries_total{dependency=observability-labels-api}"),
        1
    );
    assert_eq!(
        counters.get(
            "backstop_success_after_attempt_total{attempt=2,dependency=observability-labels-api}"
        ),
        1
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn breaker_transitions_refusals_and_unknown_outcomes_are_counted() {
    let counters = Counters::default();
    let _metrics = metrics::set_default_local_recorder(&counters);
    let down = service_fn(|_req: Request<String>| async {
        Err::<Response<()>, _>(io::Error::from(io::ErrorKind::ConnectionReset))
    });
    let breaker = Breaker::new(BreakerConfig::default().consecutive_failures(2)).unwrap();
    let svc = Backstop::http("observability-carrier-api")
        .budget(
            Budget::new(backstop::budget::BudgetConfig::default().min_retries_per_sec(0.0))
                .unwrap(),
        )
        .breaker(breaker)
        .rng(RngSource::seeded(2))
        .build()
        .unwrap()
        .layer(down);
    for _ in 0..3 {
        let _ = svc
            .clone()
            .oneshot(
                Request::get("http://carrier.local/rates")
                    .body(String::new())
                    .unwrap(),
            )
            .await;
    }
    assert_eq!(
        counters.get("backstop_calls_total{dependency=observability-carrier-api}"),
        3
    );
    // No budget floor and no deposits yet in the window beyond 3 requests: 10 % of 1 request is
    // less than one retry, so every retry is refused.
    assert_eq!(
        counters.get("backstop_budget_refusals_total{dependency=observability-carrier-api}"),
        2
    );
    assert_eq!(
        counters.get("backstop_unknown_outcomes_total{dependency=observability-carrier-api}"),
        2
    );
    assert_eq!(
        counters
            .get("backstop_breaker_transitions_total{dependency=observability-carrier-api,from=closed,to=open}"),
        1
    );
    assert_eq!(
        counters.get("backstop_breaker_rejections_total{dependency=observability-carrier-api}"),
        1
    );
}

#[tokio::test(flavor = "current_thread")]
async fn the_journal_counts_unknown_outcomes_duplicates_prevented_people_and_successes() {
    use backstop::journal::{CallResult, Journal, Reconciled, Reconcilers, Step, StepId};
    let counters = Counters::default();
    let _metrics = metrics::set_default_local_recorder(&counters);
    let journal = Journal::in_memory().await.unwrap();

    let invoice = StepId::new("run-m", "invoice", "");
    let ok = || async {
        CallResult::Succeeded {
            result: None,
            provider_ref: None,
        }
    };
    journal
        .execute(&invoice, "billing", b"{}", |_| ok())
        .await
        .unwrap();
    journal
        .execute(&invoice, "billing", b"{}", |_| ok())
        .await
        .unwrap(); // a resumed run asks again
    let refund = StepId::new("run-m", "refund", "");
    journal
        .execute(&refund, "payments", b"{}", |_| async {
            CallResult::Failed {
                outcome: backstop::Outcome::Unknown,
                error: "no reply".into(),
                retry_after: None,
            }
        })
        .await
        .unwrap();
    let hooks = Reconcilers::new().tool("payments", |_: &Step| async {
        Reconciled::CannotTell {
            why: "no lookup".into(),
        }
    });
    journal.reconcile_run("run-m", &hooks).await.unwrap();

    assert_eq!(
        counters.get("backstop_journal_success_after_attempt_total{attempt=1,tool=billing}"),
        1
    );
    assert_eq!(
        counters.get("backstop_journal_duplicates_prevented_total{tool=billing}"),
        1
    );
    assert_eq!(
        counters.get("backstop_journal_unknown_outcomes_total{tool=payments}"),
        1
    );
    assert_eq!(
        counters.get("backstop_journal_human_total{tool=payments}"),
        1
    );
    assert_eq!(
        counters.get("backstop_journal_transitions_total{to=sent,tool=payments}"),
        1
    );
}

#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_run_s_retries_are_counted_per_tool_that_spent_them() {
    use backstop::{
        Run,
        mcp::{ToolCall, ToolError, ToolPolicy, ToolResult},
    };
    let counters = Counters::default();
    let _metrics = metrics::set_default_local_recorder(&counters);
    let down = service_fn(|_call: ToolCall| async {
        Err::<ToolResult, _>(ToolError::NotSent(Box::new(io::Error::from(
            io::ErrorKind::ConnectionRefused,
        ))))
    });
    let carrier = Backstop::mcp("carrier-mcp")
        .no_breaker()
        .no_budget()
        .rng(RngSource::seeded(5))
        .build()
        .unwrap()
        .layer(down);
    let run = Run::new("run-metrics").retry_budget(3);
    let call = || {
        ToolCall::new("quote", serde_json::json!({}))
            .unwrap()
            .with_policy(ToolPolicy::ReadOnly)
            .in_run(&run)
    };
    carrier.clone().oneshot(call()).await.unwrap_err(); // 2 retries
    carrier.oneshot(call()).await.unwrap_err(); // 1 retry, then refused
    assert_eq!(
        counters.get("backstop_run_retries_total{dependency=carrier-mcp}"),
        3
    );
    assert_eq!(
        counters.get("backstop_run_budget_refusals_total{dependency=carrier-mcp}"),
        1
    );
}
