//! The lost-reply double refund, over real loopback HTTP.
//!
//! A payment service books a refund and then loses its reply. The caller sees a failure and
//! does not know whether the refund happened. This demo makes the same call three ways:
//!
//! 1. a naive retry loop against an unprotected service: two refunds;
//! 2. Backstop's retry layer without an idempotency key: it refuses to repeat a POST whose
//!    outcome is unknown, and says so in words a model can act on: one refund, outcome unknown;
//! 3. the full Backstop client stack (a key derived from the action, sent on every attempt)
//!    against the service guarded by Backstop's replay layer: the repeat is recognised and the
//!    original result comes back: one refund, and a proper reply.
//!
//! Then the seed's exercise, a crash between the refund and the record of its key:
//!
//! 4. the service books the refund in its database, then its process dies before the key's
//!    record is written (the record lives apart, in the replay layer's in-memory store): the
//!    restarted service does not know the key, and the retry refunds again;
//! 5. the fix is the order of writes, made one: the transactional replay layer writes the key's
//!    record in the handler's own database transaction, so the crash takes back both and the
//!    retry refunds once. This scene needs PostgreSQL (`apt-get install postgresql`; it starts
//!    a server of its own on a loopback port) and is skipped without it.
//!
//! Run it with `cargo run --example double_refund`.

use backstop::{
    BoxError,
    backoff::RngSource,
    chaos::{ChaosLayer, FaultPlan},
    idempotency::{ActionContext, IdempotencyLayer},
    replay::{BodyError, MemoryStore, ReplayLayer, ReplayRequestBody, ReplayResponseBody},
    retry::{RetryHistory, RetryLayer},
    timeout::{AttemptTimeoutLayer, DeadlineLayer},
};
use backstop_testkit::TestServer;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::{
    convert::Infallible,
    sync::{Arc, Mutex},
    time::Duration,
};
use tower::{Layer, ServiceBuilder, ServiceExt, service_fn, util::BoxCloneSyncService};

type Server =
    BoxCloneSyncService<Request<ReplayRequestBody>, Response<ReplayResponseBody>, BoxError>;

/// The refund endpoint: books a refund, answers with its id, and loses the reply to the very
/// first request after booking (the fault layer, `backstop::chaos`). `protected` puts Backstop's replay layer in front of it.
async fn payment_service(protected: bool) -> (TestServer, Arc<Mutex<Vec<String>>>) {
    let refunds: Arc<Mutex<Vec<String>>> = Arc::default();
    let booked = refunds.clone();
    let handler = service_fn(move |req: Request<ReplayRequestBody>| {
        let booked = booked.clone();
        async move {
            let body = req.into_body().collect().await.map_err(|e| e.0)?.to_bytes();
            let mut refunds = booked.lock().unwrap();
            refunds.push(String::from_utf8_lossy(&body).into_owned());
            let result = format!(r#"{{"refund_id":"R{}","amount":49.0}}"#, refunds.len());
            Ok::<_, BoxError>(Response::new(Full::new(Bytes::from(result))))
        }
    });
    let svc: Server = if protected {
        BoxCloneSyncService::new(
            ReplayLayer::new(MemoryStore::default())
                .single_tenant()
                .layer(handler),
        )
    } else {
        BoxCloneSyncService::new(handler.map_response(|r: Response<Full<Bytes>>| {
            r.map(|b| b.map_err(|e: Infallible| match e {}).boxed_unsync())
        }))
    };
    let svc = svc.map_request(|r: Request<Incoming>| {
        r.map(|b| b.map_err(|e| BodyError(e.into())).boxed_unsync())
    });
    // The network loses the first reply, after the refund was booked: the fault layer, seeded.
    let lose_first = FaultPlan::default().lose_reply(1.0).limit(1);
    let svc = ChaosLayer::new(lose_first, 42)
        .expect("a valid fault plan")
        .layer(svc);
    (TestServer::serve(svc).await, refunds)
}

fn refund_request(url: &str) -> Request<Full<Bytes>> {
    Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"order_id":"A-7","amount":49.0}"#,
        )))
        .unwrap()
}

#[tokio::main(flavor = "current_thread")]
pub(crate) async fn main() -> Result<(), BoxError> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

    println!("1. naive retry (any error, up to three times), unprotected service:");
    let (server, refunds) = payment_service(false).await;
    for attempt in 1..=3 {
        match client
            .request(refund_request(&server.url("/refunds")))
            .await
        {
            Ok(res) => {
                let body = res.into_body().collect().await?.to_bytes();
                println!("   attempt {attempt}: {}", String::from_utf8_lossy(&body));
                break;
            }
            Err(e) => println!("   attempt {attempt}: {e}; retrying"),
        }
    }
    let naive = refunds.lock().unwrap().len();
    println!("   refunds booked: {naive}\n");

    let retry = || {
        RetryLayer::http()
            .dependency("payments-api")
            .rng(RngSource::seeded(42))
    };

    println!("2. Backstop's retry layer, no idempotency key, unprotected service:");
    let (server, refunds) = payment_service(false).await;
    let unkeyed = ServiceBuilder::new()
        .layer(DeadlineLayer::new(Duration::from_secs(10)))
        .layer(retry())
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(3)))
        .service(client.clone());
    let err = unkeyed
        .oneshot(refund_request(&server.url("/refunds")))
        .await
        .expect_err("the reply is lost");
    let err = err
        .downcast::<backstop::Error>()
        .expect("a backstop::Error");
    println!("   error for the model: {err}");
    let without_key = refunds.lock().unwrap().len();
    println!("   refunds booked: {without_key}\n");

    println!(
        "3. the Backstop stack with a key derived from the action, service behind the replay layer:"
    );
    let (server, refunds) = payment_service(true).await;
    let keyed = ServiceBuilder::new()
        // The refund service runs the replay layer: it honours keys.
        .layer(IdempotencyLayer::http().vouched(true))
        .layer(DeadlineLayer::new(Duration::from_secs(10)))
        .layer(retry())
        .layer(AttemptTimeoutLayer::new(Duration::from_secs(3)))
        .service(client);
    let mut req = refund_request(&server.url("/refunds"));
    let args = serde_json::json!({"order_id": "A-7", "amount": 49.0});
    let action = ActionContext::action_json("run-42", "issue_refund", &args)?;
    println!(
        "   key = sha256(run-42, issue_refund, canonical args) = {}",
        action.key()
    );
    req.extensions_mut().insert(action);
    let res = keyed.oneshot(req).await?;
    let attempts = RetryHistory::of(&res).map_or(1, |h| h.attempts.len());
    let replayed = res.headers().contains_key("idempotent-replayed");
    let body = res.into_body().collect().await?.to_bytes();
    println!(
        "   {attempts} attempts, same key on each; result: {} (replayed: {replayed})",
        String::from_utf8_lossy(&body)
    );
    let with_key = refunds.lock().unwrap().len();
    println!("   refunds booked: {with_key}\n");

    println!(
        "naive retry: {naive} refunds. Backstop: {without_key} without a key (and the outcome reported \
         as unknown), {with_key} with one (and the original result returned)."
    );
    assert_eq!(
        (naive, without_key, with_key),
        (2, 1, 1),
        "Backstop must never refund twice"
    );

    println!();
    // The crash scenes run their "processes" as runtimes of their own, on a thread: a crash
    // is a runtime shut down in the middle of a request, its tasks dropped where they stand.
    let (apart, together) = std::thread::spawn(crash_scenes)
        .join()
        .expect("the crash scenes")?;
    println!(
        "a crash between the refund and its record: {apart} refunds when the record is written \
         apart, {} when it is written in the same transaction.",
        together.map_or_else(|| "(skipped: no PostgreSQL)".to_owned(), |n| n.to_string())
    );
    assert_eq!(
        apart, 2,
        "the crash window reopens when the key is stored apart"
    );
    assert!(
        together.is_none_or(|n| n == 1),
        "one refund when stored together"
    );
    Ok(())
}

/// A refund request with the key the client reuses on every attempt.
fn keyed_refund(key: &str) -> Request<Full<Bytes>> {
    Request::post("/refunds")
        .header("idempotency-key", key)
        .body(Full::from(r#"{"order_id":"A-7","amount":49.0}"#))
        .unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime")
}

/// Scenes 4 and 5: refunds booked per crash, with the key's record apart from the refund, and
/// in the same transaction (`None` without PostgreSQL).
fn crash_scenes() -> Result<(usize, Option<i64>), BoxError> {
    println!("4. the key recorded apart from the refund, and a crash between the two:");
    // The service's database survives the crash; its in-memory idempotency store does not.
    let ledger: Arc<Mutex<Vec<String>>> = Arc::default();
    let (booked_tx, booked) = std::sync::mpsc::channel::<()>();
    let book = |ledger: Arc<Mutex<Vec<String>>>, crash: Option<std::sync::mpsc::Sender<()>>| {
        service_fn(move |req: Request<ReplayRequestBody>| {
            let (ledger, crash) = (ledger.clone(), crash.clone());
            async move {
                let body = req.into_body().collect().await.map_err(|e| e.0)?.to_bytes();
                ledger
                    .lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&body).into_owned());
                if let Some(crash) = crash {
                    // The crash point: the refund is booked, its key not yet recorded.
                    let _ = crash.send(());
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                }
                Ok::<_, BoxError>(Response::new(Full::new(Bytes::from("refunded"))))
            }
        })
    };
    let first = runtime();
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(book(ledger.clone(), Some(booked_tx)));
    first.spawn(svc.oneshot(keyed_refund("refund-A-7")));
    booked.recv()?;
    first.shutdown_background();
    println!("   the process died after booking the refund");
    let second = runtime();
    let svc = ReplayLayer::new(MemoryStore::default())
        .single_tenant()
        .layer(book(ledger.clone(), None));
    let res = second.block_on(svc.oneshot(keyed_refund("refund-A-7")))?;
    let apart = ledger.lock().unwrap().len();
    println!(
        "   the restarted service did not know the key: {}; refunds booked: {apart}\n",
        res.status()
    );

    println!("5. the key recorded in the same transaction as the refund:");
    if !backstop_testkit::PostgresServer::available() {
        println!("   skipped: PostgreSQL is not installed (apt-get install postgresql)\n");
        return Ok((apart, None));
    }
    let together = second.block_on(transactional_crash())?;
    Ok((apart, Some(together)))
}

/// The transactional replay layer on a PostgreSQL of the demo's own: the refund row and the
/// key's record commit together, so the crash takes back both.
async fn transactional_crash() -> Result<i64, BoxError> {
    use backstop::replay::{PgStore, PgTransaction};
    let pg = backstop_testkit::PostgresServer::start().await;
    let url = pg.url();
    let setup = PgStore::connect(&url).await?;
    sqlx::query("CREATE TABLE refunds (id bigserial PRIMARY KEY, body text NOT NULL)")
        .execute(setup.pool())
        .await?;
    let book = |crash: Option<std::sync::mpsc::Sender<()>>| {
        service_fn(move |req: Request<ReplayRequestBody>| {
            let crash = crash.clone();
            async move {
                let tx = req
                    .extensions()
                    .get::<PgTransaction>()
                    .cloned()
                    .expect("a transaction");
                let body = req.into_body().collect().await.map_err(|e| e.0)?.to_bytes();
                insert_refund(tx, String::from_utf8_lossy(&body).into_owned()).await?;
                if let Some(crash) = crash {
                    let _ = crash.send(());
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                }
                Ok::<_, BoxError>(Response::new(Full::new(Bytes::from("refunded"))))
            }
        })
    };
    let (booked_tx, booked) = std::sync::mpsc::channel::<()>();
    let url1 = url.clone();
    // The first process, on a runtime of its own, dies after the refund's INSERT.
    std::thread::spawn(move || {
        let first = runtime();
        first.block_on(async {
            let store = PgStore::connect(&url1).await.expect("PgStore");
            let svc = ReplayLayer::transactional(store)
                .single_tenant()
                .lease(Duration::from_millis(500))
                .expect("a valid lease")
                .layer(book(Some(booked_tx)));
            tokio::spawn(svc.oneshot(keyed_refund("refund-A-7")));
        });
        let _ = booked.recv();
        first.shutdown_background();
    })
    .join()
    .expect("the first process");
    println!("   the process died after the refund's INSERT, before the commit");
    let store = PgStore::connect(&url).await?;
    let svc = ReplayLayer::transactional(store)
        .single_tenant()
        .lease(Duration::from_millis(500))
        .expect("a valid lease")
        .layer(book(None));
    // The retry waits out the dead process's claim (409 while it is leased).
    let mut status = 0;
    for _ in 0..100 {
        status = svc
            .clone()
            .oneshot(keyed_refund("refund-A-7"))
            .await?
            .status()
            .as_u16();
        if status != 409 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM refunds")
        .fetch_one(setup.pool())
        .await?;
    println!("   the retry: {status}; refunds booked: {n}\n");
    Ok(n)
}

/// The refund's row, in the layer's transaction.
fn insert_refund(
    tx: backstop::replay::PgTransaction,
    body: String,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), sqlx::Error>> + Send>> {
    Box::pin(async move {
        let mut conn = tx.lock().await;
        sqlx::query("INSERT INTO refunds (body) VALUES ($1)")
            .bind(body)
            .execute(&mut *conn)
            .await
            .map(|_| ())
    })
}
