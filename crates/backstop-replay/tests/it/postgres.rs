//! The PostgreSQL store against a PostgreSQL of the test's own (`initdb` + `pg_ctl` on a free
//! loopback port), and the transactional mode.

#![cfg(feature = "postgres")]

use backstop_replay::{Claim, PgStore, PgTransaction, ReplayLayer, ReplayRequestBody, ReplayStore};
use backstop_testkit::PostgresServer;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use std::{convert::Infallible, time::Duration};
use tower::{Layer, Service, ServiceExt, service_fn};

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(3600);

/// What the PostgreSQL store does beyond the contract every store keeps (`contract.rs`): a
/// second store on the same database migrates without trouble, and expired rows are purged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_store_migrates_and_expired_rows_are_purged() {
    let pg = PostgresServer::start().await;
    let s = PgStore::connect(&pg.url()).await.unwrap();
    let again = PgStore::connect(&pg.url()).await.unwrap();
    let Claim::Claimed { .. } = s.claim("scope:k", [1; 32], LEASE).await.unwrap() else {
        panic!("a free key is claimed")
    };
    assert_eq!(
        again.claim("scope:k", [1; 32], LEASE).await.unwrap(),
        Claim::InFlight {
            fingerprint: [1; 32]
        }
    );
    let Claim::Claimed { .. } = s
        .claim("scope:gone", [4; 32], Duration::from_millis(100))
        .await
        .unwrap()
    else {
        panic!()
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(s.purge_expired().await.unwrap() >= 1);
}

fn refund(key: &str, order: &str) -> Request<Full<Bytes>> {
    Request::post("/refunds")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from(order.to_owned())))
        .unwrap()
}

/// A refund handler that writes its row in the layer's transaction, then answers as told.
fn refunds(
    then: &'static str,
) -> impl Service<
    Request<ReplayRequestBody>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future: Send,
> + Clone
+ Send
+ 'static {
    service_fn(move |req: Request<ReplayRequestBody>| async move {
        let tx = req
            .extensions()
            .get::<PgTransaction>()
            .cloned()
            .expect("a transaction");
        let order = req.into_body().collect().await.unwrap().to_bytes();
        let id: i64 = {
            let mut conn = tx.lock().await;
            sqlx::query_scalar("INSERT INTO refunds (order_id) VALUES ($1) RETURNING id")
                .bind(String::from_utf8_lossy(&order).into_owned())
                .fetch_one(&mut *conn)
                .await
                .unwrap()
        };
        match then {
            "panic" => panic!("the handler crashed after its write"),
            "busy" => Ok(Response::builder()
                .status(503)
                .body(Full::default())
                .unwrap()),
            _ => Ok(Response::builder()
                .status(201)
                .body(Full::from(format!("refund {id}")))
                .unwrap()),
        }
    })
}

/// A PostgreSQL of the test's own with a store and an empty `refunds` table.
async fn refunds_database() -> (PostgresServer, PgStore) {
    let pg = PostgresServer::start().await;
    let store = PgStore::connect(&pg.url()).await.unwrap();
    sqlx::query("CREATE TABLE refunds (id bigserial PRIMARY KEY, order_id text NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    (pg, store)
}

async fn count(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM refunds")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transactional_mode_commits_the_effect_and_the_record_together() {
    let (_pg, store) = refunds_database().await;
    let layer = || ReplayLayer::transactional(store.clone()).single_tenant();

    // Committed once, replayed after.
    let svc = layer().layer(refunds("ok"));
    let first = svc.clone().oneshot(refund("k1", "A-7")).await.unwrap();
    assert_eq!(first.status(), 201);
    let body = first.into_body().collect().await.unwrap().to_bytes();
    let again = svc.oneshot(refund("k1", "A-7")).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.into_body().collect().await.unwrap().to_bytes(), body);
    assert_eq!(count(store.pool()).await, 1);

    // A handler that crashes after its write: rolled back, the key free, a retry runs once.
    let crashed = layer()
        .layer(refunds("panic"))
        .oneshot(refund("k2", "B-8"))
        .await
        .unwrap();
    assert_eq!(
        crashed.status(),
        500,
        "nothing was committed: the caller may retry"
    );
    assert_eq!(
        count(store.pool()).await,
        1,
        "the crashed handler's write was rolled back"
    );
    // The key is released by a write the dropped guard spawns: polled for up to 10 s.
    let mut retried = None;
    for _ in 0..500 {
        let r = layer()
            .layer(refunds("ok"))
            .oneshot(refund("k2", "B-8"))
            .await
            .unwrap();
        if r.status() == 201 {
            retried = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(retried.is_some(), "the key was released");
    assert_eq!(count(store.pool()).await, 2);

    // A handler that answers 503 (refused before acting) is rolled back too.
    let busy = layer()
        .layer(refunds("busy"))
        .oneshot(refund("k3", "C-9"))
        .await
        .unwrap();
    assert_eq!(busy.status(), 503);
    assert_eq!(count(store.pool()).await, 2);
}

/// A refund handler that writes its row in the layer's transaction, says so on `written`, and
/// then stalls its thread until `go`: a paused process, in which nothing of its task runs, the
/// lease renewal included (the runtime hands its other work to another thread meanwhile).
/// A handler as the replay layer's tests hold one.
type Handler =
    tower::util::BoxCloneService<Request<ReplayRequestBody>, Response<Full<Bytes>>, Infallible>;

fn stalling(
    who: &'static str,
) -> (
    Handler,
    std::sync::mpsc::Receiver<()>,
    std::sync::mpsc::Sender<()>,
) {
    use std::sync::{Arc, Mutex, mpsc};
    let (written_tx, written) = mpsc::channel::<()>();
    let (go, go_rx) = mpsc::channel::<()>();
    let (written_tx, go_rx) = (
        Arc::new(Mutex::new(written_tx)),
        Arc::new(Mutex::new(go_rx)),
    );
    let svc = service_fn(move |req: Request<ReplayRequestBody>| {
        let (written_tx, go_rx) = (Arc::clone(&written_tx), Arc::clone(&go_rx));
        async move {
            let tx = req.extensions().get::<PgTransaction>().cloned().unwrap();
            {
                let mut conn = tx.lock().await;
                sqlx::query("INSERT INTO refunds (order_id) VALUES ($1)")
                    .bind(who)
                    .execute(&mut *conn)
                    .await
                    .unwrap();
            }
            written_tx.lock().unwrap().send(()).unwrap();
            tokio::task::block_in_place(|| go_rx.lock().unwrap().recv().unwrap());
            Ok::<_, Infallible>(
                Response::builder()
                    .status(201)
                    .body(Full::from(format!("refund by {who}")))
                    .unwrap(),
            )
        }
    });
    (Handler::new(svc), written, go)
}

async fn received(rx: std::sync::mpsc::Receiver<()>) {
    tokio::task::spawn_blocking(move || rx.recv().unwrap())
        .await
        .unwrap();
}

/// The model checker's "outage past the lease" interleaving, closed by the fencing token: the
/// first owner's process stalls past its lease; a repeat claims the expired key and its handler
/// runs; the stale owner wakes first and tries to commit, and its fenced write finds the newer
/// token: its refund and record are rolled back (409 `lease-lost`). The repeat commits. One
/// refund, by the owner that holds the claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_owner_past_its_lease_commits_nothing() {
    let (_pg, store) = refunds_database().await;
    let lease = Duration::from_millis(300);
    let layer = || {
        ReplayLayer::transactional(store.clone())
            .single_tenant()
            .lease(lease)
            .unwrap()
            .ttl(TTL)
            .unwrap()
    };
    let (stale, stale_wrote, stale_go) = stalling("the stale owner");
    let first = tokio::spawn(layer().layer(stale).oneshot(refund("k-stale", "A-7")));
    received(stale_wrote).await;
    // Past the lease (a lower bound: a slower machine only makes it longer).
    tokio::time::sleep(lease * 2).await;
    let (owner, owner_wrote, owner_go) = stalling("the new owner");
    let repeat = tokio::spawn(layer().layer(owner).oneshot(refund("k-stale", "A-7")));
    received(owner_wrote).await;
    // The stale owner wakes while the new owner's handler still runs.
    stale_go.send(()).unwrap();
    let stale = first.await.unwrap().unwrap();
    let problem = stale.into_body().collect().await.unwrap().to_bytes();
    let problem = String::from_utf8_lossy(&problem).into_owned();
    assert!(problem.contains("lease-lost"), "{problem}");
    owner_go.send(()).unwrap();
    let repeat = repeat.await.unwrap().unwrap();
    assert_eq!(repeat.status(), 201);
    let rows: Vec<String> = sqlx::query_scalar("SELECT order_id FROM refunds")
        .fetch_all(store.pool())
        .await
        .unwrap();
    assert_eq!(
        rows,
        ["the new owner"],
        "one refund, by the owner holding the claim"
    );
    let again = layer()
        .layer(refunds("ok"))
        .oneshot(refund("k-stale", "A-7"))
        .await
        .unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(
        again.into_body().collect().await.unwrap().to_bytes(),
        "refund by the new owner"
    );
}

#[cfg(feature = "axum")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_axum_handler_takes_the_transaction_as_an_extractor() {
    use axum::{Router, routing::post};
    use http::StatusCode;

    async fn book(tx: PgTransaction, order: String) -> (StatusCode, String) {
        let mut conn = tx.lock().await;
        let id: i64 = sqlx::query_scalar("INSERT INTO refunds (order_id) VALUES ($1) RETURNING id")
            .bind(order)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        (StatusCode::CREATED, format!("refund {id}"))
    }

    let (_pg, store) = refunds_database().await;
    let app = Router::new().route("/refunds", post(book));
    let svc = ReplayLayer::transactional(store.clone())
        .single_tenant()
        .layer(app);
    let first = svc.clone().oneshot(refund("ax-1", "A-7")).await.unwrap();
    assert_eq!(first.status(), 201);
    let again = svc.oneshot(refund("ax-1", "A-7")).await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(count(store.pool()).await, 1);

    // Without a transactional layer in front, the extractor refuses.
    let bare = Router::new().route("/refunds", post(book));
    let res = bare
        .oneshot(
            Request::post("/refunds")
                .body(axum::body::Body::from("A-1"))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), 500);
}
