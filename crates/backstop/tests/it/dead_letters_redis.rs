//! Dead letters on a Redis stream, against a `redis-server` of the test's own (append-only
//! file, fsync always): written off the call's path, read once each by a consumer group and
//! acknowledged, kept across a Redis crash and restart, and counted when a full queue drops
//! them.

#![cfg(feature = "dead-letters-redis")]

use backstop::{
    Backstop,
    dead_letters_redis::{DeadLetterStream, RedisStreamSink, StreamConfig},
};
use backstop_testkit::RedisServer;
use http::{Request, Response};
use std::{collections::HashSet, sync::Arc, time::Duration};
use tower::{Layer, ServiceExt, service_fn};

/// A payment service whose every reply is lost after it (perhaps) acted: each refund is a dead
/// letter (not repeated: nobody vouched for its key).
fn failing()
-> impl tower::Service<Request<String>, Response = Response<()>, Error = std::io::Error, Future: Send>
+ Clone
+ Send
+ 'static {
    service_fn(|_req: Request<String>| async {
        Err::<Response<()>, _>(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "the reply was lost",
        ))
    })
}

async fn refunds(sink: &RedisStreamSink, n: usize) {
    let stack = Backstop::http("dead-letters-redis-payments-api")
        .no_breaker()
        .dead_letters(Arc::new(sink.clone()))
        .build()
        .unwrap()
        .layer(failing());
    for i in 0..n {
        let req = Request::post(format!("http://payments.local/refunds/{i}"))
            .body(String::new())
            .unwrap();
        assert!(stack.clone().oneshot(req).await.is_err());
    }
}

async fn written(sink: &RedisStreamSink, n: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sink.stats().written < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} letters written: {:?}",
            sink.stats()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn letters_are_written_read_once_acknowledged_and_survive_a_restart() {
    let mut redis = RedisServer::start_persistent().await;
    let sink = RedisStreamSink::connect(&redis.url(), "dead-letters", StreamConfig::default())
        .await
        .unwrap();
    refunds(&sink, 20).await;
    written(&sink, 20).await;

    let ops = DeadLetterStream::connect(&redis.url(), "dead-letters")
        .await
        .unwrap();
    let all = ops.list(100).await.unwrap();
    assert_eq!(all.len(), 20);
    assert_eq!(
        all[0].letter["dependency"],
        "dead-letters-redis-payments-api"
    );
    assert_eq!(all[0].letter["outcome"], "unknown");
    // Two operators share the group: each letter goes to one of them.
    ops.create_group("ops").await.unwrap();
    ops.create_group("ops").await.unwrap(); // again: it exists, no error
    let a = ops.read("ops", "ana", 12).await.unwrap();
    let b = ops.read("ops", "bo", 12).await.unwrap();
    assert_eq!((a.len(), b.len()), (12, 8));
    let ids: HashSet<_> = a.iter().chain(&b).map(|l| l.id.clone()).collect();
    assert_eq!(ids.len(), 20, "no letter given twice");
    assert_eq!(ops.pending("ops").await.unwrap(), 20);
    let settled: Vec<String> = a.iter().map(|l| l.id.clone()).collect();
    assert_eq!(ops.ack("ops", &settled).await.unwrap(), 12);
    assert_eq!(ops.pending("ops").await.unwrap(), 8);

    // Redis crashes and comes back: the letters are there, and the sink writes again.
    redis.kill();
    redis.restart().await;
    let ops = DeadLetterStream::connect(&redis.url(), "dead-letters")
        .await
        .unwrap();
    assert_eq!(
        ops.list(100).await.unwrap().len(),
        20,
        "kept across the restart"
    );
    assert_eq!(
        ops.pending("ops").await.unwrap(),
        8,
        "and what is still pending"
    );
    refunds(&sink, 5).await;
    written(&sink, 25).await;
    assert_eq!(ops.list(100).await.unwrap().len(), 25);
    assert_eq!(sink.stats().dropped, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_drops_letters_and_counts_them_without_blocking_the_call() {
    let mut redis = RedisServer::start_persistent().await;
    let config = StreamConfig {
        queue: 2,
        ..StreamConfig::default()
    };
    let sink = RedisStreamSink::connect(&redis.url(), "dead-letters", config)
        .await
        .unwrap();
    redis.kill();
    // Redis is down: the writer holds one letter and retries; two wait in the queue.
    let calls = tokio::time::timeout(Duration::from_secs(10), refunds(&sink, 10)).await;
    assert!(calls.is_ok(), "the calls never wait for Redis");
    let stats = sink.stats();
    assert!(stats.dropped >= 7, "{stats:?}");
    assert!(stats.dropped <= 8, "{stats:?}");
    // Every letter is accounted for while Redis is down: the kept ones are pending.
    assert_eq!(
        stats.written + stats.dropped + stats.pending,
        10,
        "{stats:?}"
    );
    assert_eq!(stats.pending, 10 - stats.dropped, "{stats:?}");
    redis.restart().await;
    let kept = 10 - stats.dropped;
    written(&sink, kept).await;
    assert!(sink.stats().write_errors > 0);
    assert_eq!(sink.stats().pending, 0, "{:?}", sink.stats());
    let ops = DeadLetterStream::connect(&redis.url(), "dead-letters")
        .await
        .unwrap();
    assert_eq!(ops.list(100).await.unwrap().len() as u64, kept);
}
