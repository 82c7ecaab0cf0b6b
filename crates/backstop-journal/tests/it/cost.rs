//! What a step costs the journal's database, counted on the wire: a PostgreSQL cluster of the
//! test's own behind a proxy that counts round trips and the statements that write.

#![cfg(feature = "postgres")]

use backstop_journal::{CallResult, Journal, RunContext, StepId, Worker};
use backstop_testkit::{PgWireCounter, PostgresServer};

async fn steps(j: &Journal, run: &str, n: usize) {
    for i in 0..n {
        let step = StepId::new(run, &format!("step-{i}"), "");
        j.execute(&step, "carrier", b"{}", |_| async {
            CallResult::Succeeded {
                result: Some("\"ok\"".into()),
                provider_ref: None,
            }
        })
        .await
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_costs_two_writes_and_two_round_trips_at_most() {
    let pg = PostgresServer::start().await;
    let upstream = format!(
        "127.0.0.1:{}",
        pg.url()
            .rsplit_once(':')
            .unwrap()
            .1
            .split('/')
            .next()
            .unwrap()
    );
    let proxy = PgWireCounter::start(upstream.parse().unwrap()).await;
    let j = Journal::postgres(&proxy.url_for(&pg.url())).await.unwrap();
    // Every statement prepared, every connection of the pool open.
    steps(&j, "warm-up", 20).await;

    proxy.reset();
    let n = 50;
    steps(&j, "counted", n).await;
    let (trips, writes) = (proxy.round_trips(), proxy.writes());
    println!(
        "per step: {:.2} round trips, {:.2} writes",
        trips as f64 / n as f64,
        writes as f64 / n as f64
    );
    assert!(writes <= 2 * n as u64, "{writes} writes for {n} steps");
    // sent, outcome: one round trip each.
    assert!(trips <= 2 * n as u64, "{trips} round trips for {n} steps");
    assert!(writes >= n as u64, "the counter sees the writes: {writes}");

    // A step inside a workflow run by the worker costs the same.
    let w = Worker::new(j.clone(), "w1").workflow("one", |ctx: RunContext| async move {
        ctx.step("only", "carrier", b"{}", |_| async {
            CallResult::Succeeded {
                result: None,
                provider_ref: None,
            }
        })
        .await?;
        Ok(None)
    });
    j.start_run("warm", "one", None).await.unwrap();
    w.run_until_idle().await.unwrap();
    let n = 20;
    for i in 0..n {
        j.start_run(&format!("run-{i}"), "one", None).await.unwrap();
    }
    proxy.reset();
    let handled = w.run_until_idle().await.unwrap();
    assert_eq!(handled.len(), n);
    println!(
        "per run of one step, claim and finish included: {:.2} round trips, {:.2} writes",
        proxy.round_trips() as f64 / n as f64,
        proxy.writes() as f64 / n as f64
    );
}
