//! A refund server for the crash test (`tests/it/crash_replay.rs`): `POST /refunds` behind the
//! replay layer, each refund booked as a row in PostgreSQL, and a place to be killed.
//!
//! `crash_server MODE PG_URL REDIS_URL HOLD`: MODE is `redis` (the Redis store; the refund row
//! committed on its own) or `pg-tx` (the transactional PostgreSQL store; the row written in the
//! layer's transaction). HOLD is where the server stops for a minute, after printing a line,
//! so the test can kill it there: `before` (prints `STARTED`, before the refund), `after-effect`
//! (prints `EFFECT`, after it), `after-record` (prints `RECORDED`, after the layer stored the
//! result, before the reply is sent), or `none`. It prints `LISTENING <port>` when it serves.

use backstop::replay::{OnVolatile, PgStore, PgTransaction, RedisStore, ReplayLayer};
use backstop_testkit::TestServer;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use std::{io::Write, time::Duration};
use tower::{Layer, ServiceExt, service_fn, util::BoxCloneSyncService};

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Where the server stops, to be killed there.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Hold {
    Nowhere,
    Before,
    AfterEffect,
    AfterRecord,
}

async fn hold_if(hold: Hold, here: Hold, line: &'static str) {
    if hold == here {
        say(line);
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
}

const INSERT: &str = "INSERT INTO refunds (order_id) VALUES ($1) RETURNING id";

/// Books the refund: in the layer's transaction (committed with the stored result, or not at
/// all), or else committed at once, apart from the idempotency record.
fn book(
    pool: sqlx::PgPool,
    tx: Option<PgTransaction>,
    order: String,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<i64, sqlx::Error>> + Send>> {
    Box::pin(async move {
        match tx {
            Some(tx) => {
                let mut conn = tx.lock().await;
                sqlx::query_scalar(INSERT)
                    .bind(order)
                    .fetch_one(&mut *conn)
                    .await
            }
            None => {
                sqlx::query_scalar(INSERT)
                    .bind(order)
                    .fetch_one(&pool)
                    .await
            }
        }
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, mode, pg_url, redis_url, hold] = &args[..] else {
        panic!(
            "usage: crash_server redis|pg-tx PG_URL REDIS_URL none|before|after-effect|after-record"
        )
    };
    let hold = match hold.as_str() {
        "none" => Hold::Nowhere,
        "before" => Hold::Before,
        "after-effect" => Hold::AfterEffect,
        "after-record" => Hold::AfterRecord,
        other => panic!("unknown hold {other}"),
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(pg_url)
        .await
        .expect("PostgreSQL");
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS refunds (id bigserial PRIMARY KEY, order_id text NOT NULL)",
    )
    .execute(&pool)
    .await
    .expect("the refunds table");
    // A short lease, so that the test's retry does not wait long for a dead server's claim.
    let layer = match mode.as_str() {
        "redis" => ReplayLayer::new(
            RedisStore::connect(redis_url, OnVolatile::Refuse)
                .await
                .expect("a persistent Redis"),
        ),
        "pg-tx" => ReplayLayer::transactional(PgStore::connect(pg_url).await.expect("PgStore")),
        other => panic!("unknown mode {other}"),
    }
    .single_tenant()
    .lease(Duration::from_millis(600))
    .expect("a valid lease");

    let refunds = service_fn(move |req: Request<backstop::replay::ReplayRequestBody>| {
        let pool = pool.clone();
        async move {
            hold_if(hold, Hold::Before, "STARTED").await;
            let tx = req.extensions().get::<PgTransaction>().cloned();
            let order = req.into_body().collect().await?.to_bytes();
            let order = String::from_utf8_lossy(&order).into_owned();
            let id = book(pool, tx, order.clone()).await?;
            say(&format!("EFFECT {order}"));
            hold_if(hold, Hold::AfterEffect, "HOLDING").await;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(
                Response::builder()
                    .status(201)
                    .body(Full::new(Bytes::from(format!("refund {id}"))))
                    .expect("a response"),
            )
        }
    });
    // Boxed, so that the compiler proves `Send` here, on concrete types.
    let replay: BoxCloneSyncService<
        Request<Incoming>,
        Response<backstop::replay::ReplayResponseBody>,
        Box<dyn std::error::Error + Send + Sync>,
    > = BoxCloneSyncService::new(layer.layer(refunds));
    let front = service_fn(move |req: Request<Incoming>| {
        let replay = replay.clone();
        async move {
            let res = replay.oneshot(req).await?;
            hold_if(hold, Hold::AfterRecord, "RECORDED").await;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(res)
        }
    });
    let server = TestServer::serve(front).await;
    say(&format!("LISTENING {}", server.addr().port()));
    std::future::pending::<()>().await;
}
