//! The fleet link's two tasks on Redis: one writes this process's reports and asks for trial
//! leases, one reads the other processes' reports off the stream.

use super::{Link, Out, Trial};
use backstop_core::Dependency;
use redis::{
    AsyncConnectionConfig, Client, RedisResult, Value, aio::MultiplexedConnection,
    streams::StreamReadReply,
};
use std::{
    collections::HashMap,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};
use tokio::{sync::mpsc, time::Instant};

fn config() -> AsyncConnectionConfig {
    AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(Some(Duration::from_secs(2)))
}

async fn connect(link: &Link, client: &Client) -> MultiplexedConnection {
    loop {
        match client
            .get_multiplexed_async_connection_with_config(&config())
            .await
        {
            Ok(c) => return c,
            Err(_) => {
                link.set_connected(false);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Puts this process's reports on the stream and asks for trial leases.
pub(super) async fn write(link: Arc<Link>, client: Client, mut rx: mpsc::Receiver<Out>) {
    let mut conn = connect(&link, &client).await;
    while let Some(out) = rx.recv().await {
        let result = match &out {
            Out::Report {
                dependency,
                open,
                cooldown,
                calls,
            } => {
                let r: RedisResult<Value> = redis::cmd("XADD")
                    .arg(&link.config.stream)
                    .arg("MAXLEN")
                    .arg("~")
                    .arg(10_000)
                    .arg("*")
                    .arg("process")
                    .arg(&link.config.id)
                    .arg("dependency")
                    .arg(dependency.as_str())
                    .arg("state")
                    .arg(if *open { "open" } else { "closed" })
                    .arg("cooldown_ms")
                    .arg(u64::try_from(cooldown.as_millis()).unwrap_or(u64::MAX))
                    .arg("calls")
                    .arg(*calls)
                    .query_async(&mut conn)
                    .await;
                r.map(|_| link.counts.published.fetch_add(1, Ordering::Relaxed))
                    .map(|_| ())
            }
            Out::AskTrial { dependency, lease } => {
                let key = format!("{}:trial:{}", link.config.stream, dependency.as_str());
                let r: RedisResult<Option<String>> = redis::cmd("SET")
                    .arg(&key)
                    .arg(&link.config.id)
                    .arg("NX")
                    .arg("PX")
                    .arg(u64::try_from(lease.as_millis()).unwrap_or(u64::MAX).max(1))
                    .query_async(&mut conn)
                    .await;
                r.map(|won| {
                    let until = Instant::now() + *lease;
                    let trial = if won.is_some() {
                        link.counts.won.fetch_add(1, Ordering::Relaxed);
                        Trial::Won(until)
                    } else {
                        link.counts.lost.fetch_add(1, Ordering::Relaxed);
                        Trial::Lost(until)
                    };
                    link.trials
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(dependency.clone(), trial);
                })
            }
        };
        match result {
            Ok(()) => link.set_connected(true),
            Err(e) => {
                tracing::debug!(target: "backstop::breaker", error = %e, "fleet: write failed");
                link.counts.dropped.fetch_add(1, Ordering::Relaxed);
                if let Out::AskTrial { dependency, .. } = &out {
                    // No answer: the process decides alone, as with no fleet.
                    link.trials
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(
                            dependency.clone(),
                            Trial::Won(Instant::now() + Duration::from_secs(1)),
                        );
                }
                link.set_connected(false);
                conn = connect(&link, &client).await;
            }
        }
    }
}

/// Reads the other processes' reports as they arrive (`XREAD BLOCK`).
pub(super) async fn read(link: Arc<Link>, client: Client) {
    let mut conn = connect(&link, &client).await;
    // From the newest report on: older ones are history (each is dated by its id, and one older
    // than its cooldown counts for nothing anyway).
    let mut last = last_id(&mut conn, &link.config.stream)
        .await
        .unwrap_or_else(|| "0-0".to_owned());
    loop {
        let reply: RedisResult<Option<StreamReadReply>> = redis::cmd("XREAD")
            .arg("BLOCK")
            .arg(500)
            .arg("COUNT")
            .arg(100)
            .arg("STREAMS")
            .arg(&link.config.stream)
            .arg(&last)
            .query_async(&mut conn)
            .await;
        match reply {
            Ok(reply) => {
                link.set_connected(true);
                for key in reply.map(|r| r.keys).unwrap_or_default() {
                    for entry in key.ids {
                        last.clone_from(&entry.id);
                        handle(&link, &entry.id, &entry.map);
                    }
                }
            }
            Err(e) => {
                tracing::debug!(target: "backstop::breaker", error = %e, "fleet: read failed");
                link.set_connected(false);
                tokio::time::sleep(Duration::from_millis(200)).await;
                conn = connect(&link, &client).await;
            }
        }
    }
}

/// The id of the stream's newest entry, so that reading goes on from there.
async fn last_id(conn: &mut MultiplexedConnection, stream: &str) -> Option<String> {
    let info: RedisResult<Value> = redis::cmd("XREVRANGE")
        .arg(stream)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query_async(conn)
        .await;
    match info.ok()? {
        Value::Array(entries) => match entries.first()? {
            Value::Array(entry) => match entry.first()? {
                Value::BulkString(id) => String::from_utf8(id.clone()).ok(),
                _ => None,
            },
            _ => None,
        },
        _ => None,
    }
}

fn field(map: &HashMap<String, Value>, name: &str) -> Option<String> {
    match map.get(name)? {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// What is left of a report's `cooldown` now (`now_ms`, Unix milliseconds), from its stream
/// `id` (`<Unix ms>-<seq>`): a report read late (after a reconnect) counts only for the rest of
/// its cooldown, and an expired one not at all.
fn left_of(id: &str, cooldown: Duration, now_ms: u64) -> Option<Duration> {
    let at: u64 = id.split('-').next()?.parse().ok()?;
    let age = Duration::from_millis(now_ms.saturating_sub(at));
    cooldown.checked_sub(age).filter(|left| !left.is_zero())
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// One report of another process.
fn handle(link: &Link, id: &str, map: &HashMap<String, Value>) {
    let (Some(process), Some(dependency), Some(state)) = (
        field(map, "process"),
        field(map, "dependency"),
        field(map, "state"),
    ) else {
        return;
    };
    if process == link.config.id {
        return;
    }
    link.counts.received.fetch_add(1, Ordering::Relaxed);
    let dependency = Dependency::new(dependency);
    let calls: u64 = field(map, "calls")
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let cooldown = Duration::from_millis(
        field(map, "cooldown_ms")
            .and_then(|c| c.parse().ok())
            .unwrap_or(0),
    );
    match state.as_str() {
        "open" if calls >= link.config.min_calls => {
            if let Some(left) = left_of(id, cooldown, unix_ms()) {
                link.reported_open(&dependency, &process, left);
            }
        }
        "closed" => link.reported_closed(&dependency),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_counts_for_what_is_left_of_its_cooldown() {
        let cooldown = Duration::from_secs(30);
        let now = 1_800_000_000_000;
        assert_eq!(left_of(&format!("{now}-0"), cooldown, now), Some(cooldown));
        assert_eq!(
            left_of(&format!("{}-3", now - 10_000), cooldown, now),
            Some(Duration::from_secs(20))
        );
        // Read after its cooldown (a reader that was away): it counts for nothing.
        assert_eq!(left_of(&format!("{}-0", now - 30_000), cooldown, now), None);
        assert_eq!(left_of(&format!("{}-0", now - 90_000), cooldown, now), None);
        // A clock behind the writer's: the whole cooldown, never more.
        assert_eq!(
            left_of(&format!("{}-0", now + 5_000), cooldown, now),
            Some(cooldown)
        );
        assert_eq!(left_of("not-an-id", cooldown, now), None);
    }
}
