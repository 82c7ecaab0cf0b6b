//! The `backstop journal` commands, run as a user runs them (the real binary), over a SQLite
//! journal and a PostgreSQL one that a workflow wrote.

use backstop_core::Outcome;
use backstop_journal::{
    CallResult, Journal, Reconciled, Reconcilers, RunContext, RunError, Step, StepId, Worker,
};
use std::{process::Command, time::Duration};

#[path = "cli/console.rs"]
mod console;

/// The `backstop` binary run with `args`: its exit code, standard output and error.
fn run_cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_backstop"))
        .args(args)
        .output()
        .expect("the backstop binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn backstop(db: &str, args: &[&str]) -> (i32, String, String) {
    run_cli(&[&["journal", "--db", db][..], args].concat())
}

/// `backstop journal --help` lists every exit code a script may branch on.
#[test]
fn the_journal_help_lists_the_exit_codes() {
    let (code, out, err) = run_cli(&["journal", "--help"]);
    assert_eq!(code, 0, "{err}");
    for n in 0..=5 {
        assert!(out.contains(&format!("{n} ")), "exit code {n} in:\n{out}");
    }
    assert!(out.contains("Exit codes: 0 done;"), "{out}");
    assert!(out.contains("5 stuck --fail-if-any found steps"), "{out}");
}

/// A run with a done step, a step nobody can tell about, and a parked one.
async fn write_a_run(j: &Journal) {
    let invoice = StepId::new("run-1", "invoice", "");
    j.execute(&invoice, "billing", b"{}", |_| async {
        CallResult::Succeeded {
            result: Some("{\"invoice\":\"inv_1\"}".into()),
            provider_ref: Some("inv_1".into()),
        }
    })
    .await
    .unwrap();
    let reserve = StepId::new("run-1", "reserve", "");
    j.execute(&reserve, "inventory", b"{}", |_| async {
        CallResult::Failed {
            outcome: Outcome::Unknown,
            error: "the inventory service did not answer within 2 s".into(),
            retry_after: None,
        }
    })
    .await
    .unwrap();
    let hooks = Reconcilers::new().tool("inventory", |_: &Step| async {
        Reconciled::CannotTell {
            why: "inventory has no lookup by key".into(),
        }
    });
    j.reconcile_run("run-1", &hooks).await.unwrap();
    let email = StepId::new("run-1", "email", "");
    j.execute(&email, "mailer", b"{}", |_| async {
        CallResult::Failed {
            outcome: Outcome::NotSent,
            error: "mailer is unavailable (circuit open)".into(),
            retry_after: Some(Duration::from_secs(600)),
        }
    })
    .await
    .unwrap();
}

/// A run of workflow `charge` whose charge failed for good: its worker failed the run.
async fn write_a_failed_run(j: &Journal) {
    j.start_run("run-2", "charge", Some("{\"eur\":40}"))
        .await
        .unwrap();
    let worker =
        Worker::new(j.clone(), "worker-1").workflow("charge", |ctx: RunContext| async move {
            ctx.step("charge", "payments", b"{}", |_| async {
                CallResult::Failed {
                    outcome: Outcome::Completed,
                    error: "payments answered 422: card declined".into(),
                    retry_after: None,
                }
            })
            .await
            .map_err(|_| RunError::failed("step run-2/charge failed: card declined"))?;
            Ok(None)
        });
    assert_eq!(worker.run_until_idle().await.unwrap().len(), 1);
}

/// The operator steers runs: by state, retry, stub, cancel; each refusal with its exit code.
fn steer(db: &str) {
    let (code, out, err) = backstop(db, &["runs", "--state", "failed"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("run-2") && !out.contains("run-1"), "{out}");
    let (code, out, err) = backstop(db, &["runs", "--workflow", "charge"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("run-2") && !out.contains("run-1"), "{out}");
    let (code, out, err) = backstop(db, &["runs", "--workflow", "charge", "--state", "pending"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("no runs"), "{out}");
    let (code, _, err) = backstop(db, &["runs", "--state", "done"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("invalid value 'done' for '--state") && err.contains("needs_human"),
        "{err}"
    );

    let who = ["--by", "ana", "--why", "the customer updated the card"];
    let (code, out, err) = backstop(db, &[&["retry", "run-2", "charge"][..], &who].concat());
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("pending") && out.contains("sent again with key"),
        "{out}"
    );
    let (code, out, _) = backstop(db, &["--json", "runs", "--state", "pending"]);
    assert_eq!(code, 0);
    let pending: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(
        pending
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["run"] == "run-2" && r["workflow"] == "charge"),
        "{out}"
    );

    let (code, _, err) = backstop(
        db,
        &[&["stub", "run-2", "charge", "--result", "ch_9"][..], &who].concat(),
    );
    assert_eq!(code, 2, "a result that is not JSON: {err}");
    assert!(err.contains("must be JSON"), "{err}");
    let (code, out, err) = backstop(
        db,
        &[
            &["stub", "run-2", "charge", "--result", "\"ch_9\""][..],
            &who,
        ]
        .concat(),
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("reconciled_succeeded"), "{out}");

    let (code, out, err) = backstop(db, &[&["cancel", "run-2"][..], &who].concat());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("cancelled"), "{out}");
    let (code, _, err) = backstop(db, &[&["cancel", "run-2"][..], &who].concat());
    assert_eq!(code, 4, "a cancelled run is over: {err}");
    let (code, _, err) = backstop(db, &[&["retry", "run-2", "charge"][..], &who].concat());
    assert_eq!(code, 4, "{err}");
    let (code, _, _) = backstop(db, &[&["cancel", "run-404"][..], &who].concat());
    assert_eq!(code, 3);
    let (code, _, _) = backstop(db, &[&["retry", "run-2", "nope"][..], &who].concat());
    assert_eq!(code, 3);

    let (code, out, _) = backstop(db, &["show", "run-2"]);
    assert_eq!(code, 0);
    for want in [
        "run run-2: cancelled (workflow charge)",
        "failed by worker-1",
        "reopened by ana",
        "cancelled by ana: the customer updated the card",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
    fork(db);
}

/// The operator forks the cancelled run at its step; every refusal says why, with its code.
fn fork(db: &str) {
    let who = ["--by", "ana", "--why", "charge the new card"];
    let fork = |run: &str, from: &str, new: &str| {
        backstop(
            db,
            &[&["fork", run, "--from", from, "--as", new][..], &who].concat(),
        )
    };
    let (code, _, err) = fork("run-1", "email", "run-1b");
    assert_eq!(code, 4, "run-1 is pending: {err}");
    assert!(
        err.contains("it is pending") && err.contains("cancel it first"),
        "{err}"
    );
    // A step the run does not have is not found, as a missing run is (3), not refused (4).
    let (code, _, err) = fork("run-2", "refund", "run-3");
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("step \"refund\" of run run-2 (its steps are charge)"),
        "{err}"
    );
    let (code, _, _) = fork("run-404", "charge", "run-3");
    assert_eq!(code, 3);
    let (code, _, err) = fork("run-2", "charge", "run-1");
    assert_eq!(code, 4, "run-1 is another run: {err}");
    assert!(err.contains("exists already"), "{err}");

    let (code, out, err) = fork("run-2", "charge", "run-3");
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("run run-3 is pending: forked from run run-2"),
        "{out}"
    );
    let (code, _, err) = fork("run-2", "charge", "run-3");
    assert_eq!(code, 0, "the same fork again is the fork as it is: {err}");
    let (code, out, _) = backstop(db, &["--json", "show", "run-3"]);
    assert_eq!(code, 0);
    let shown: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(shown["run"]["forked_from"]["run"], "run-2", "{out}");
    assert_eq!(shown["run"]["workflow"], "charge", "{out}");
    assert_eq!(shown["run"]["input"], "{\"eur\":40}", "{out}");
    assert_eq!(shown["steps"].as_array().unwrap().len(), 0, "{out}");
    let (_, out, _) = backstop(db, &["show", "run-2"]);
    assert!(
        out.contains("forked into run run-3 at step charge (pending)")
            && out.contains("forked by ana: into run run-3 at step charge: charge the new card"),
        "{out}"
    );
    let (_, out, _) = backstop(db, &["show", "run-3"]);
    assert!(
        out.contains("forked from run run-2 at step charge"),
        "{out}"
    );
}

fn operate(db: &str) {
    let (code, out, err) = backstop(db, &["runs"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("run-1") && out.contains("needs_human"),
        "{out}"
    );

    let (code, out, _) = backstop(db, &["show", "run-1"]);
    assert_eq!(code, 0);
    for want in [
        "invoice",
        "succeeded",
        "reserve",
        "requires_reconciliation (needs a person)",
        "parked (wakes in 10 min",
        "did not answer within 2 s",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
    assert!(
        out.contains("sent ") && out.contains("pending "),
        "time in each state:\n{out}"
    );

    let (code, out, _) = backstop(db, &["--json", "show", "run-1"]);
    assert_eq!(code, 0);
    let shown: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(shown["run"]["state"], "needs_human");
    let steps = &shown["steps"];
    assert_eq!(steps.as_array().unwrap().len(), 3);
    assert_eq!(steps[1]["state"], "requires_reconciliation");
    // pending, sent, unknown, requires_reconciliation, and the hand-over to a person.
    assert_eq!(steps[1]["history"].as_array().unwrap().len(), 5);
    // A step that is over is not waiting in its last state: no duration for it.
    assert_eq!(
        steps[0]["time_in_state_ms"]["succeeded"],
        serde_json::Value::Null
    );
    assert!(steps[0]["time_in_state_ms"]["sent"].is_u64());

    let (code, out, _) = backstop(db, &["stuck", "--fail-if-any"]);
    assert_eq!(code, 5, "stuck steps exit 5 with --fail-if-any");
    assert!(
        out.contains("a person: inventory has no lookup by key") && out.contains("its time"),
        "{out}"
    );

    // A result that is not JSON is refused as `stub` refuses it, and nothing is stored.
    let (code, _, err) = backstop(
        db,
        &[
            "resolve",
            "run-1",
            "reserve",
            "--succeeded",
            "--result",
            "not-json",
            "--by",
            "ana",
            "--why",
            "checked",
        ],
    );
    assert_eq!(code, 2, "a result that is not JSON: {err}");
    assert!(err.contains("the result must be JSON"), "{err}");
    let (code, out, err) = backstop(
        db,
        &[
            "resolve",
            "run-1",
            "reserve",
            "--succeeded",
            "--by",
            "ana",
            "--why",
            "the warehouse shows reservation res_9",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("reconciled_succeeded"), "{out}");
    let (code, _, err) = backstop(
        db,
        &[
            "resolve", "run-1", "reserve", "--retry", "--by", "ana", "--why", "again",
        ],
    );
    assert_eq!(code, 4, "a step that is over is not repaired again: {err}");
    assert!(err.contains("reconciled_succeeded"), "{err}");

    let (code, _, err) = backstop(db, &["show", "run-404"]);
    assert_eq!(code, 3);
    assert!(err.contains("run-404 is not in the journal"), "{err}");
    let (code, _, err) = backstop(
        db,
        &[
            "resolve", "run-1", "nope", "--failed", "--by", "a", "--why", "b",
        ],
    );
    assert_eq!(code, 3, "{err}");
    let (code, _, _) = backstop(
        db,
        &["resolve", "run-1", "reserve", "--by", "a", "--why", "b"],
    );
    assert_eq!(code, 2, "a resolution must be chosen");
}

#[tokio::test]
async fn the_operator_reads_and_repairs_a_sqlite_journal() {
    let dir = backstop_testkit::scratch_dir("cli");
    let db = dir.path().join("journal.db");
    let j = Journal::sqlite(&db).await.unwrap();
    write_a_run(&j).await;
    write_a_failed_run(&j).await;
    tokio::task::spawn_blocking(move || {
        operate(db.to_str().unwrap());
        steer(db.to_str().unwrap());
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn the_operator_reads_and_repairs_a_postgres_journal() {
    let pg = backstop_testkit::PostgresServer::start().await;
    let url = pg.url();
    let j = Journal::postgres(&url).await.unwrap();
    write_a_run(&j).await;
    write_a_failed_run(&j).await;
    tokio::task::spawn_blocking(move || {
        operate(&url);
        steer(&url);
    })
    .await
    .unwrap();
}

#[test]
fn a_missing_journal_or_database_is_a_clear_error() {
    let (code, _, err) = backstop("/nonexistent/journal.db", &["runs"]);
    assert_eq!(code, 3);
    assert!(
        err.contains("no journal at /nonexistent/journal.db") && err.contains("--db"),
        "{err}"
    );
    let (code, _, err) = backstop("postgres://nobody@127.0.0.1:1/none", &["runs"]);
    assert_eq!(code, 1);
    assert!(err.contains("cannot open the journal"), "{err}");
}

/// `show` reads a run in a fixed number of queries, however many steps it has: the statements
/// it executes, counted on the wire through a proxy in front of the test's own PostgreSQL (not
/// round trips, which include what the pool spends on its connections and so vary with load).
#[tokio::test]
async fn show_reads_a_run_in_a_fixed_number_of_queries() {
    let pg = backstop_testkit::PostgresServer::start().await;
    let upstream = pg
        .url()
        .rsplit_once(':')
        .unwrap()
        .1
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let proxy =
        backstop_testkit::PgWireCounter::start(format!("127.0.0.1:{upstream}").parse().unwrap())
            .await;
    let url = proxy.url_for(&pg.url());
    let j = Journal::postgres(&pg.url()).await.unwrap();
    for (run, steps) in [("small", 2), ("large", 20)] {
        for i in 0..steps {
            let step = StepId::new(run, &format!("step-{i}"), "");
            j.execute(&step, "billing", b"{}", |_| async {
                CallResult::Succeeded {
                    result: None,
                    provider_ref: None,
                }
            })
            .await
            .unwrap();
        }
    }
    let mut statements = Vec::new();
    for run in ["small", "large"] {
        proxy.reset();
        let url = url.clone();
        let (code, out, err) = tokio::task::spawn_blocking(move || backstop(&url, &["show", run]))
            .await
            .unwrap();
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("step-1"), "{out}");
        statements.push(proxy.statements());
    }
    assert!(
        statements[0] > 0,
        "the proxy sees the queries: {statements:?}"
    );
    assert_eq!(
        statements[0], statements[1],
        "2 steps and 20 steps: {statements:?} statements"
    );
}

fn letters(redis: &str, args: &[&str]) -> (i32, String, String) {
    run_cli(&[&["letters", "--redis", redis][..], args].concat())
}

/// The operator reads dead letters from the stream with a consumer group and acknowledges
/// them, with the real binary against a `redis-server` of the test's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_reads_and_acknowledges_dead_letters() {
    use backstop::dead_letters_redis::{RedisStreamSink, StreamConfig};
    use tower::{Layer, ServiceExt};
    let redis = backstop_testkit::RedisServer::start().await;
    let sink = RedisStreamSink::connect(&redis.url(), "dead-letters", StreamConfig::default())
        .await
        .unwrap();
    let lost = tower::service_fn(|_req: http::Request<String>| async {
        Err::<http::Response<()>, _>(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "the reply was lost",
        ))
    });
    let stack = backstop::Backstop::http("payments-api")
        .no_breaker()
        .dead_letters(std::sync::Arc::new(sink.clone()))
        .build()
        .unwrap()
        .layer(lost);
    for i in 0..3 {
        let req = http::Request::post(format!("http://payments.local/refunds/{i}"))
            .body(String::new())
            .unwrap();
        assert!(stack.clone().oneshot(req).await.is_err());
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sink.stats().written < 3 {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", sink.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let url = redis.url();
    tokio::task::spawn_blocking(move || {
        let (code, out, err) = letters(&url, &["list"]);
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains("payments-api") && out.contains("unknown"),
            "{out}"
        );
        let (code, out, err) = letters(
            &url,
            &[
                "--json",
                "read",
                "--group",
                "ops",
                "--consumer",
                "ana",
                "--count",
                "2",
            ],
        );
        assert_eq!(code, 0, "{err}");
        let read: serde_json::Value = serde_json::from_str(&out).unwrap();
        let ids: Vec<String> = read
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["id"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(ids.len(), 2);
        let (code, out, _) = letters(&url, &["read", "--group", "ops", "--consumer", "bo"]);
        assert_eq!(code, 0);
        let rows = out
            .lines()
            .filter(|l| l.contains("┆ payments-api ┆"))
            .count();
        assert_eq!(rows, 1, "the one left: {out}");
        let mut ack = vec!["ack", "--group", "ops"];
        ack.extend(ids.iter().map(String::as_str));
        let (code, out, err) = letters(&url, &ack);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("2 of 2 acknowledged"), "{out}");
        let (code, _, _) = letters(&url, &["ack", "--group", "ops"]);
        assert_eq!(code, 2, "ids are required");
        let (code, _, err) = letters("redis://127.0.0.1:1/", &["list"]);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("cannot reach Redis"), "{err}");
    })
    .await
    .unwrap();
}

/// `value` with every time in it replaced: a timestamp (RFC 3339) by `[time]`, milliseconds
/// by state (`time_in_state_ms`) by `[ms]`: what is left is the shape and the facts a snapshot
/// holds.
fn without_times(mut value: serde_json::Value) -> serde_json::Value {
    fn walk(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::String(s) if chrono::DateTime::parse_from_rfc3339(s).is_ok() => {
                *v = "[time]".into();
            }
            serde_json::Value::Object(map) => {
                for (k, field) in map.iter_mut() {
                    match field {
                        serde_json::Value::Object(by) if k.ends_with("_ms") => by
                            .values_mut()
                            .filter(|ms| ms.is_number())
                            .for_each(|ms| *ms = "[ms]".into()),
                        _ => walk(field),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut value);
    value
}

/// What the commands print, as snapshots (`cargo insta review` after a change on purpose):
/// the tables people read and the JSON scripts parse. Times are replaced (and the tables'
/// padding, which their widths set), since they are the only thing a second run changes.
#[tokio::test]
async fn what_the_commands_print() {
    let dir = backstop_testkit::scratch_dir("cli-snapshots");
    let db = dir.path().join("journal.db").display().to_string();
    let j = Journal::sqlite(&db).await.unwrap();
    write_a_run(&j).await;
    write_a_failed_run(&j).await;
    // Times in words, and the padding their widths give the tables' columns.
    let times = [
        (r"\d+(\.\d+)? (ms|s|min|h)\b", "[duration]"),
        (r"\w{3}, \d{2} \w{3} \d{4} \d{2}:\d{2}:\d{2} GMT", "[date]"),
        ("─+", "─"),
        ("═+", "═"),
        (" {2,}", " "),
    ];
    let json = |args: &[&str]| {
        let (code, out, err) = backstop(&db, args);
        assert_eq!(code, 0, "{err}");
        without_times(serde_json::from_str(&out).expect("JSON"))
    };
    // Keys sorted: whether serde_json keeps their order depends on the features the build
    // unifies, not on what the command printed.
    insta::with_settings!({ sort_maps => true }, {
        insta::assert_json_snapshot!("runs_json", json(&["--json", "runs"]));
        insta::assert_json_snapshot!("show_json", json(&["--json", "show", "run-1"]));
        insta::assert_json_snapshot!("stuck_json", json(&["--json", "stuck"]));
    });
    insta::with_settings!({ filters => times.to_vec() }, {
        for (name, args) in [
            ("runs_table", &["runs"][..]),
            ("show_table", &["show", "run-1"][..]),
            ("stuck_table", &["stuck"][..]),
        ] {
            let (code, out, err) = backstop(&db, args);
            assert_eq!(code, 0, "{err}");
            insta::assert_snapshot!(name, out);
        }
    });
}
