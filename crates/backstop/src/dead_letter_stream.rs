//! Dead letters on a Redis stream (feature `dead-letters-redis`): [`RedisStreamSink`] writes
//! each letter with `XADD` (the stream capped near a length), never on the failing call's
//! path: `record` puts the letter in a bounded queue and a task of its own writes it, waiting
//! out a Redis that is down; what a full queue cannot take is dropped and counted.
//! [`DeadLetterStream`] is the operator's side: read the letters with a consumer group and
//! acknowledge the ones settled, so each is handled once even with several readers.

use crate::{BoxError, DeadLetter, DeadLetterSink};
use redis::{AsyncCommands, aio::ConnectionManager, streams::StreamReadOptions};
use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};
use tokio::sync::mpsc;

/// How a [`RedisStreamSink`] queues and caps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamConfig {
    /// Letters waiting to be written, at most (past that a letter is dropped, and counted).
    pub queue: usize,
    /// The stream is trimmed to about this many letters (`MAXLEN ~`).
    pub max_len: usize,
}

impl Default for StreamConfig {
    /// 1,024 queued, 100,000 kept.
    fn default() -> Self {
        StreamConfig {
            queue: 1_024,
            max_len: 100_000,
        }
    }
}

/// What a [`RedisStreamSink`] did, counted since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamStats {
    /// Letters written to the stream.
    pub written: u64,
    /// Letters dropped because the queue was full (Redis slower than the failures, or down).
    pub dropped: u64,
    /// Letters taken and not written yet (queued, or in the writer's hands while Redis is
    /// down): `written + dropped + pending` is every letter the sink was given.
    pub pending: u64,
    /// Writes that failed and were tried again (Redis down or restarting).
    pub write_errors: u64,
}

#[derive(Debug, Default)]
struct Counts {
    /// Letters the queue took.
    taken: AtomicU64,
    written: AtomicU64,
    dropped: AtomicU64,
    write_errors: AtomicU64,
}

/// Writes dead letters to a Redis stream, one JSON field (`letter`) per entry, off the call's
/// path. See [`dead_letters_redis`](crate::dead_letters_redis).
#[derive(Clone)]
pub struct RedisStreamSink {
    queue: mpsc::Sender<String>,
    counts: Arc<Counts>,
    stream: Arc<str>,
}

impl fmt::Debug for RedisStreamSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStreamSink")
            .field("stream", &self.stream)
            .field("stats", &self.stats())
            .finish()
    }
}

impl RedisStreamSink {
    /// Connects to the Redis at `url` (within 5 s) and starts the writer task on the current
    /// Tokio runtime, writing to `stream`.
    pub async fn connect(url: &str, stream: &str, config: StreamConfig) -> Result<Self, BoxError> {
        let conn = connect(url).await?;
        let (tx, mut rx) = mpsc::channel::<String>(config.queue.max(1));
        let counts = Arc::new(Counts::default());
        let (c, name, max_len) = (counts.clone(), stream.to_owned(), config.max_len.max(1));
        tokio::spawn(async move {
            let mut conn = conn;
            while let Some(letter) = rx.recv().await {
                let mut wait = Duration::from_millis(50);
                loop {
                    let added: Result<String, _> = redis::cmd("XADD")
                        .arg(&name)
                        .arg("MAXLEN")
                        .arg("~")
                        .arg(max_len)
                        .arg("*")
                        .arg("letter")
                        .arg(&letter)
                        .query_async(&mut conn)
                        .await;
                    match added {
                        Ok(_) => {
                            c.written.fetch_add(1, Ordering::Release);
                            break;
                        }
                        Err(e) => {
                            // Kept, and tried again: the connection manager reconnects.
                            c.write_errors.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(target: "backstop::dead_letters", error = %e, "writing a dead letter failed; trying again");
                            tokio::time::sleep(wait).await;
                            wait = (wait * 2).min(Duration::from_secs(2));
                        }
                    }
                }
            }
        });
        Ok(RedisStreamSink {
            queue: tx,
            counts,
            stream: Arc::from(stream),
        })
    }

    /// What has been written, dropped, is pending and was retried.
    pub fn stats(&self) -> StreamStats {
        // Written is read first: a letter written between the two reads counts as pending,
        // never as neither.
        let written = self.counts.written.load(Ordering::Acquire);
        let taken = self.counts.taken.load(Ordering::Acquire);
        StreamStats {
            written,
            dropped: self.counts.dropped.load(Ordering::Relaxed),
            pending: taken.saturating_sub(written),
            write_errors: self.counts.write_errors.load(Ordering::Relaxed),
        }
    }
}

impl DeadLetterSink for RedisStreamSink {
    fn record(&self, letter: DeadLetter) {
        // Counted as taken before it is queued, so the writer can never count it written first.
        self.counts.taken.fetch_add(1, Ordering::Release);
        if self.queue.try_send(letter.to_json().to_string()).is_err() {
            self.counts.taken.fetch_sub(1, Ordering::Release);
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(target: "backstop::dead_letters", stream = %self.stream, "dead letter queue full: a letter was dropped");
        }
    }
}

async fn connect(url: &str) -> Result<ConnectionManager, BoxError> {
    let client = redis::Client::open(url)?;
    let conn = tokio::time::timeout(Duration::from_secs(5), ConnectionManager::new(client))
        .await
        .map_err(|_| format!("connecting to Redis at {url} timed out"))??;
    Ok(conn)
}

/// One dead letter read from the stream.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct StreamLetter {
    /// The entry's id in the stream (what [`DeadLetterStream::ack`] takes).
    pub id: String,
    /// The letter, as [`DeadLetter::to_json`] wrote it.
    pub letter: serde_json::Value,
}

/// The operator's side of a dead-letter stream: list, read with a consumer group, acknowledge.
#[derive(Clone)]
pub struct DeadLetterStream {
    conn: ConnectionManager,
    stream: String,
}

impl fmt::Debug for DeadLetterStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeadLetterStream")
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl DeadLetterStream {
    /// The stream `stream` on the Redis at `url`.
    pub async fn connect(url: &str, stream: &str) -> Result<Self, BoxError> {
        Ok(DeadLetterStream {
            conn: connect(url).await?,
            stream: stream.to_owned(),
        })
    }

    /// The letters in the stream, oldest first, at most `count`.
    pub async fn list(&self, count: usize) -> Result<Vec<StreamLetter>, BoxError> {
        let mut conn = self.conn.clone();
        let reply: redis::streams::StreamRangeReply =
            conn.xrange_count(&self.stream, "-", "+", count).await?;
        reply.ids.into_iter().map(letter_of).collect()
    }

    /// Creates consumer group `group` (reading from the start of the stream) if it does not
    /// exist yet.
    pub async fn create_group(&self, group: &str) -> Result<(), BoxError> {
        let mut conn = self.conn.clone();
        let created: Result<(), redis::RedisError> =
            conn.xgroup_create_mkstream(&self.stream, group, "0").await;
        match created {
            Ok(()) => Ok(()),
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Up to `count` letters no consumer of `group` has been given yet, given to `consumer`:
    /// each letter goes to one consumer of the group, and stays pending until acknowledged.
    pub async fn read(
        &self,
        group: &str,
        consumer: &str,
        count: usize,
    ) -> Result<Vec<StreamLetter>, BoxError> {
        let mut conn = self.conn.clone();
        let options = StreamReadOptions::default()
            .group(group, consumer)
            .count(count);
        let reply: redis::streams::StreamReadReply = conn
            .xread_options(&[&self.stream], &[">"], &options)
            .await?;
        reply
            .keys
            .into_iter()
            .flat_map(|k| k.ids)
            .map(letter_of)
            .collect()
    }

    /// Acknowledges the letters `ids` for `group` (settled): returns how many were pending.
    pub async fn ack(&self, group: &str, ids: &[String]) -> Result<u64, BoxError> {
        let mut conn = self.conn.clone();
        Ok(conn.xack(&self.stream, group, ids).await?)
    }

    /// How many letters `group` has been given and not acknowledged.
    pub async fn pending(&self, group: &str) -> Result<u64, BoxError> {
        let mut conn = self.conn.clone();
        let reply: redis::streams::StreamPendingReply = conn.xpending(&self.stream, group).await?;
        Ok(reply.count() as u64)
    }
}

fn letter_of(entry: redis::streams::StreamId) -> Result<StreamLetter, BoxError> {
    let text: String = entry
        .get("letter")
        .ok_or_else(|| format!("stream entry {} has no letter field", entry.id))?;
    Ok(StreamLetter {
        letter: serde_json::from_str(&text)?,
        id: entry.id,
    })
}
