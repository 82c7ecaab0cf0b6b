//! The double refund after a crash, with a real process killed with SIGKILL.
//!
//! `examples/support/bin/crash_server.rs` books each refund as a row in PostgreSQL behind the replay layer,
//! and stops where the test asks: before the refund, after it (before the result is stored),
//! or after the result is stored (before the reply is sent). The test kills it there, starts a
//! new one, and retries with the same key. With the Redis store, the refund and its record are
//! two writes: a crash between them books the refund twice. With the transactional PostgreSQL
//! store they commit together: exactly once, at every kill point.

use backstop_testkit::{PostgresServer, RedisServer};
use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

/// A crash server and the lines it prints.
struct Server {
    child: Child,
    lines: mpsc::Receiver<String>,
    port: u16,
}

impl Server {
    fn start(mode: &str, pg: &str, redis: &str, hold: &str) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_crash_server"))
            .args([mode, pg, redis, hold])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the crash server starts");
        let out = child.stdout.take().expect("its stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut server = Server {
            child,
            lines,
            port: 0,
        };
        let listening = server.wait_for("LISTENING");
        server.port = listening
            .trim_start_matches("LISTENING ")
            .parse()
            .expect("a port");
        server
    }

    fn wait_for(&self, prefix: &str) -> String {
        loop {
            match self.lines.recv_timeout(Duration::from_secs(20)) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(_) => {}
                Err(e) => panic!("the crash server never printed {prefix}: {e}"),
            }
        }
    }

    /// SIGKILL: no destructor, no graceful shutdown, no rollback by the process itself.
    fn kill(mut self) {
        self.child.kill().expect("SIGKILL");
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn post(port: u16, key: &str, order: &str) -> Result<u16, String> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = Request::post(format!("http://127.0.0.1:{port}/refunds"))
        .header("idempotency-key", key)
        .body(Full::from(order.to_owned()))
        .unwrap();
    match tokio::time::timeout(Duration::from_secs(5), client.request(req)).await {
        Ok(Ok(res)) => Ok(res.status().as_u16()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("no reply in 5 s".into()),
    }
}

async fn refunds_for(pool: &sqlx::PgPool, order: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM refunds WHERE order_id = $1")
        .bind(order)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_refunds_twice_with_redis_and_once_with_the_transactional_store() {
    let pg = PostgresServer::start().await;
    let redis = RedisServer::start_persistent().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&pg.url())
        .await
        .unwrap();
    let mut seen = Vec::new();
    for mode in ["redis", "pg-tx"] {
        for (hold, marker) in [
            ("before", "STARTED"),
            ("after-effect", "EFFECT"),
            ("after-record", "RECORDED"),
        ] {
            let key = format!("{mode}-{hold}");
            let order = format!("order-{mode}-{hold}");
            let server = Server::start(mode, &pg.url(), &redis.url(), hold);
            let port = server.port;
            let (k, o) = (key.clone(), order.clone());
            let first = tokio::spawn(async move { post(port, &k, &o).await });
            let marker_seen = tokio::task::spawn_blocking({
                let lines = server;
                move || {
                    lines.wait_for(marker);
                    lines
                }
            })
            .await
            .unwrap();
            marker_seen.kill();
            assert!(first.await.unwrap().is_err(), "the client saw the crash");

            // A new process; the client retries with the same key until it gets an answer
            // (409 while the dead server's claim is still leased; up to 30 s, a bound only so
            // that a server that never answers fails: a loaded machine starts it slowly).
            let server = Server::start(mode, &pg.url(), &redis.url(), "none");
            let mut status = 0;
            for _ in 0..300 {
                match post(server.port, &key, &order).await {
                    Ok(409) | Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                    Ok(s) => {
                        status = s;
                        break;
                    }
                }
            }
            assert_eq!(
                status, 201,
                "{mode}, killed {hold}: the retry gets the refund"
            );
            let n = refunds_for(&pool, &order).await;
            seen.push((mode, hold, n));
            server.kill();
        }
    }
    assert_eq!(
        seen,
        vec![
            ("redis", "before", 1),
            ("redis", "after-effect", 2),
            ("redis", "after-record", 1),
            ("pg-tx", "before", 1),
            ("pg-tx", "after-effect", 1),
            ("pg-tx", "after-record", 1),
        ],
        "refunds booked per kill point: the Redis store books twice when killed between the \
         refund and its record; the transactional store never does"
    );
}
