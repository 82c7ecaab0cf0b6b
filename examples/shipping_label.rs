//! A fulfilment agent, on tokio's paused clock.
//!
//! The agent calls `purchase_shipping_label(order_id, carrier, service)`; the runtime derives
//! the idempotency key from (run id, step id, tool-call id). The carrier API (in-process here,
//! so the clock can be paused; the HTTP tests use real sockets) sits behind Backstop's replay
//! layer. Four scenes:
//!
//! 1. The carrier commits the purchase, then the connection drops before the response: the
//!    stack retries with the same key and receives the original label. One charge.
//! 2. The carrier is busy: 429 with `Retry-After: 2`. The stack waits as asked.
//! 3. The address is rejected (400 `address_unverifiable`): no retry; the model is told what to
//!    ask the customer.
//! 4. A 20-minute carrier outage: the breaker opens, the model is told to stop, and the carrier
//!    sees a trial call per cooldown instead of a stream of retries.
//! 5. The model calls the tool again for the same order with other arguments (express instead
//!    of ground): a new tool call, so a new key. The business identity holds anyway: the
//!    carrier's database allows one active label per order (a unique index), checked inside the
//!    transactional replay layer's transaction, and the call gets the existing label. This
//!    scene runs on a PostgreSQL of its own (skipped when PostgreSQL is not installed) and on the
//!    real clock.
//!
//! Run it with `cargo run --example shipping_label`.

use backstop::{
    Backstop, BoxError, Preset,
    backoff::RngSource,
    breaker::{Breaker, BreakerConfig},
    budget::Budget,
    idempotency::ActionContext,
    replay::{MemoryStore, ReplayLayer, ReplayRequestBody, ReplayResponseBody},
    retry::RetryHistory,
    timeout::TimedBody,
};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use std::{
    io,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt, service_fn, util::BoxCloneSyncService};

/// What the carrier does next.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Carrier {
    Normal,
    LoseNextReply,
    BusyOnce,
    Down,
}

type CarrierService =
    BoxCloneSyncService<Request<Full<Bytes>>, Response<ReplayResponseBody>, BoxError>;

fn carrier(
    mode: Arc<Mutex<Carrier>>,
    labels: Arc<AtomicU32>,
    seen: Arc<AtomicU32>,
) -> CarrierService {
    let api = service_fn(move |req: Request<ReplayRequestBody>| {
        let labels = labels.clone();
        async move {
            let body = req.into_body().collect().await.map_err(|e| e.0)?.to_bytes();
            let order: serde_json::Value = serde_json::from_slice(&body)?;
            if order["address"]["apartment"].is_null()
                && order["address"]["needs_apartment"] == true
            {
                let problem =
                    r#"{"error":"address_unverifiable","detail":"missing apartment number"}"#;
                return Ok::<_, BoxError>(
                    Response::builder()
                        .status(400)
                        .body(Full::new(Bytes::from(problem)))?,
                );
            }
            let n = labels.fetch_add(1, Ordering::SeqCst) + 1;
            let label = format!(
                r#"{{"label_id":"LBL-{n}","tracking":"1Z999AA1{n:08}","charged_usd":8.40}}"#
            );
            let _ = mode;
            Ok(Response::builder()
                .status(201)
                .body(Full::new(Bytes::from(label)))?)
        }
    });
    // The carrier's own replay layer, then the network in front of it.
    let front = BoxCloneSyncService::new(
        ReplayLayer::new(MemoryStore::default())
            .single_tenant()
            .layer(api),
    );
    BoxCloneSyncService::new(tower::service_fn(move |req: Request<Full<Bytes>>| {
        let mut inner = front.clone();
        let mode = mode.clone();
        seen.fetch_add(1, Ordering::SeqCst);
        async move {
            let now = *mode.lock().unwrap();
            match now {
                Carrier::Down => {
                    return Ok(Response::builder()
                        .status(503)
                        .body(full(r#"{"error":"maintenance"}"#))?);
                }
                Carrier::BusyOnce => {
                    *mode.lock().unwrap() = Carrier::Normal;
                    return Ok(Response::builder()
                        .status(429)
                        .header("retry-after", "2")
                        .body(full(""))?);
                }
                _ => {}
            }
            let res = inner.ready().await?.call(req).await?;
            if now == Carrier::LoseNextReply {
                *mode.lock().unwrap() = Carrier::Normal;
                // The label was bought; the connection drops before the response arrives.
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    "connection reset by peer",
                )
                .into());
            }
            Ok(res)
        }
    }))
}

fn full(s: &'static str) -> ReplayResponseBody {
    Full::new(Bytes::from_static(s.as_bytes()))
        .map_err(|e| match e {})
        .boxed_unsync()
}

fn purchase(step: &str, call: &str, order: serde_json::Value) -> Request<Full<Bytes>> {
    let mut req = Request::post("http://carrier.local/labels")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(order.to_string())))
        .unwrap();
    req.extensions_mut()
        .insert(ActionContext::tool_call("run-91f2", step, call));
    req
}

/// What the tool returns to the model: the label, or an actionable sentence.
async fn tool_reply(
    res: Result<Response<TimedBody<ReplayResponseBody>>, backstop::Error>,
) -> String {
    match res {
        Ok(r) if r.status().is_success() => {
            let replayed = r.headers().contains_key("idempotent-replayed");
            let attempts = RetryHistory::of(&r).map_or(1, RetryHistory::sent);
            let body = r
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            format!(
                "label purchased: {} ({attempts} attempt(s){})",
                String::from_utf8_lossy(&body),
                if replayed {
                    ", original result replayed"
                } else {
                    ""
                }
            )
        }
        Ok(r) => {
            let status = r.status();
            let body = r
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            if v["error"] == "address_unverifiable" {
                format!(
                    "address failed carrier validation: {}",
                    v["detail"].as_str().unwrap_or("unknown reason")
                )
            } else {
                format!("the carrier answered {status}; do not retry now; tell the user")
            }
        }
        Err(e) => e.to_string(),
    }
}

#[tokio::main(flavor = "current_thread", start_paused = true)]
pub(crate) async fn main() -> Result<(), BoxError> {
    let mode = Arc::new(Mutex::new(Carrier::Normal));
    let (labels, seen) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let api = carrier(mode.clone(), labels.clone(), seen.clone());
    let breaker = Breaker::new(BreakerConfig::default().cooldown(Duration::from_secs(60))).unwrap();
    let tool = Backstop::http("carrier-api")
        .preset(Preset::Create)
        .p99(Duration::from_millis(1200))
        .budget(Budget::default())
        .breaker(breaker)
        .rng(RngSource::seeded(340))
        .build()?
        .layer(api);
    let order = serde_json::json!({"order_id": "ORD-4812", "carrier": "UPS", "service": "ground",
                                   "address": {"street": "1 Main St", "apartment": "4B"}});

    println!("1. the carrier commits the purchase, then the connection drops:");
    *mode.lock().unwrap() = Carrier::LoseNextReply;
    let res = tool
        .clone()
        .oneshot(purchase("step-3", "call-07", order.clone()))
        .await;
    println!("   -> {}", tool_reply(res).await);
    println!("   labels bought: {}\n", labels.load(Ordering::SeqCst));
    assert_eq!(labels.load(Ordering::SeqCst), 1, "one charge, not two");

    println!("2. the carrier is busy (429, Retry-After: 2):");
    *mode.lock().unwrap() = Carrier::BusyOnce;
    let start = Instant::now();
    let res = tool
        .clone()
        .oneshot(purchase("step-4", "call-08", order.clone()))
        .await;
    println!(
        "   -> {} after {:?}\n",
        tool_reply(res).await,
        start.elapsed()
    );

    println!("3. an address the carrier cannot verify:");
    let bad = serde_json::json!({"order_id": "ORD-4813", "carrier": "UPS", "service": "ground",
                                 "address": {"street": "9 Elm St", "needs_apartment": true}});
    let before = seen.load(Ordering::SeqCst);
    let res = tool
        .clone()
        .oneshot(purchase("step-5", "call-09", bad))
        .await;
    println!("   -> {}", tool_reply(res).await);
    println!(
        "   requests sent: {} (no retry; the agent asks the customer)\n",
        seen.load(Ordering::SeqCst) - before
    );

    println!("4. a 20-minute carrier outage; the agent tries a label every 30 s:");
    *mode.lock().unwrap() = Carrier::Down;
    let before = seen.load(Ordering::SeqCst);
    let start = Instant::now();
    let mut told_to_stop = None;
    let mut calls = 0;
    while start.elapsed() < Duration::from_secs(20 * 60) {
        calls += 1;
        let res = tool
            .clone()
            .oneshot(purchase("step-6", &format!("call-{calls}"), order.clone()))
            .await;
        let reply = tool_reply(res).await;
        if told_to_stop.is_none() && reply.contains("circuit open") {
            told_to_stop = Some((start.elapsed(), reply));
        }
        tokio::time::sleep(Duration::from_secs(30)).await;
    }
    let (when, reply) = told_to_stop.expect("the breaker opened");
    let sent = seen.load(Ordering::SeqCst) - before;
    println!("   after {:?} the model was told: {reply}", when);
    println!(
        "   {calls} tool calls in 20 min; requests that reached the carrier: {sent} (3 attempts each would have been {})",
        calls * 3
    );
    *mode.lock().unwrap() = Carrier::Normal;
    tokio::time::sleep(Duration::from_secs(60)).await;
    let res = tool.oneshot(purchase("step-7", "call-99", order)).await;
    println!("   the carrier is back: {}", tool_reply(res).await);
    assert!(
        sent < calls,
        "the breaker kept most calls away from the failing carrier"
    );

    println!("\n5. the model buys a label again for the same order, with other arguments:");
    if backstop_testkit::PostgresServer::available() {
        let labels = std::thread::spawn(business_identity)
            .join()
            .expect("scene 5")?;
        assert_eq!(labels, 1, "one active label per order");
    } else {
        println!("   skipped: PostgreSQL is not installed (apt-get install postgresql)");
    }
    Ok(())
}

/// The carrier's label service on PostgreSQL: one active label per order, enforced by a unique
/// index inside the replay layer's transaction.
fn business_identity() -> Result<i64, BoxError> {
    use backstop::replay::{PgStore, PgTransaction};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let pg = backstop_testkit::PostgresServer::start().await;
        let store = PgStore::connect(&pg.url()).await?;
        for ddl in [
            "CREATE TABLE labels (id bigserial PRIMARY KEY, order_id text NOT NULL, \
             service text NOT NULL, active boolean NOT NULL DEFAULT true)",
            "CREATE UNIQUE INDEX one_active_label_per_order ON labels (order_id) WHERE active",
        ] {
            sqlx::query(ddl).execute(store.pool()).await?;
        }
        let api = service_fn(|req: Request<ReplayRequestBody>| async move {
            let tx = req
                .extensions()
                .get::<PgTransaction>()
                .cloned()
                .expect("a transactional layer");
            let body = req.into_body().collect().await.map_err(|e| e.0)?.to_bytes();
            let order: serde_json::Value = serde_json::from_slice(&body)?;
            let (id, service, existing) = buy_label(
                tx,
                order["order_id"].as_str().unwrap_or_default().to_owned(),
                order["service"].as_str().unwrap_or_default().to_owned(),
            )
            .await?;
            let label = format!(r#"{{"label_id":"LBL-{id}","service":"{service}"}}"#);
            Ok::<_, BoxError>(
                Response::builder()
                    .status(if existing { 200 } else { 201 })
                    .body(Full::new(Bytes::from(label)))?,
            )
        });
        let carrier = ReplayLayer::transactional(store.clone())
            .single_tenant()
            .layer(api);
        let tool = Backstop::http("carrier-api")
            .preset(Preset::Create)
            .budget(Budget::default())
            .no_breaker()
            .build()?
            .layer(carrier);
        let ground =
            serde_json::json!({"order_id": "ORD-4900", "carrier": "UPS", "service": "ground"});
        let express =
            serde_json::json!({"order_id": "ORD-4900", "carrier": "UPS", "service": "express"});
        let first = tool
            .clone()
            .oneshot(purchase("step-8", "call-10", ground))
            .await;
        println!("   first call:  {}", tool_reply(first).await);
        let again = tool.oneshot(purchase("step-9", "call-11", express)).await;
        println!(
            "   second call: {} (the existing label)",
            tool_reply(again).await
        );
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM labels")
            .fetch_one(store.pool())
            .await?;
        println!("   labels bought for ORD-4900: {n}");
        Ok(n)
    })
}

/// A label: its id, its service, and whether the order already had it.
type Label = (i64, String, bool);

/// A boxed database future (boxed, so the compiler proves `Send` on concrete types).
type DbFuture<T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, sqlx::Error>> + Send>>;

/// Buys a label in the layer's transaction, or finds the order's active one.
fn buy_label(
    tx: backstop::replay::PgTransaction,
    order: String,
    service: String,
) -> DbFuture<Label> {
    Box::pin(async move {
        let mut conn = tx.lock().await;
        let bought: Option<i64> = sqlx::query_scalar(
            "INSERT INTO labels (order_id, service) VALUES ($1, $2) \
             ON CONFLICT (order_id) WHERE active DO NOTHING RETURNING id",
        )
        .bind(&order)
        .bind(&service)
        .fetch_optional(&mut *conn)
        .await?;
        if let Some(id) = bought {
            return Ok((id, service, false));
        }
        let (id, service): (i64, String) =
            sqlx::query_as("SELECT id, service FROM labels WHERE order_id = $1 AND active")
                .bind(&order)
                .fetch_one(&mut *conn)
                .await?;
        Ok((id, service, true))
    })
}
