//! A primary, its replica and three Sentinels of the test's own, on loopback, stopped when
//! dropped.

use crate::{RedisServer, Role};
use std::{process::Command, time::Duration};

/// A Redis primary (persistent), one replica of it and three Sentinels monitoring it as
/// `backstop` (down after 1 s, quorum 2), on free loopback ports.
///
/// Needs `redis-server` and `redis-cli` on the `PATH`.
#[derive(Debug)]
pub struct RedisSentinel {
    primary: RedisServer,
    replica: RedisServer,
    sentinels: Vec<RedisServer>,
}

impl RedisSentinel {
    /// Starts them and waits until the replica is in sync and every Sentinel knows the
    /// replica.
    pub async fn start() -> RedisSentinel {
        let primary = RedisServer::start_as(Role::Alone).await;
        let replica = RedisServer::start_as(Role::ReplicaOf(primary.port())).await;
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            sentinels.push(RedisServer::start_as(Role::Sentinel(primary.port())).await);
        }
        let topology = RedisSentinel {
            primary,
            replica,
            sentinels,
        };
        topology
            .wait_for(|t| {
                cli(t.replica.port(), &["INFO", "replication"]).contains("master_link_status:up")
            })
            .await;
        topology
            .wait_for(|t| {
                t.sentinels.iter().all(|s| {
                    cli(s.port(), &["SENTINEL", "REPLICAS", "backstop"])
                        .contains(&t.replica.port().to_string())
                })
            })
            .await;
        topology
    }

    /// The Sentinels' URLs.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::url).collect()
    }

    /// The name the Sentinels know the primary by.
    pub fn primary_name(&self) -> &'static str {
        "backstop"
    }

    /// Waits until the replica has every write the primary took (`WAIT 1`).
    pub fn replicated(&self) {
        let acked = cli(self.primary.port(), &["WAIT", "1", "2000"]);
        assert_eq!(acked.trim(), "1", "the replica did not acknowledge in 2 s");
    }

    /// Kills the primary (`SIGKILL`).
    pub fn kill_primary(&mut self) {
        self.primary.kill();
    }

    /// Waits until the Sentinels have promoted the replica, and returns how long that took
    /// from the call.
    pub async fn promoted(&self) -> Duration {
        let started = tokio::time::Instant::now();
        self.wait_for(|t| {
            cli(t.replica.port(), &["ROLE"])
                .lines()
                .next()
                .is_some_and(|l| l.trim() == "master")
        })
        .await;
        started.elapsed()
    }

    async fn wait_for(&self, ok: impl Fn(&Self) -> bool) {
        for _ in 0..600 {
            if ok(self) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("the Sentinel topology did not reach the state waited for within 15 s");
    }
}

fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli must be installed to run the Redis Sentinel tests: `apt-get install redis-tools` (Debian, Ubuntu), or run `scripts/test`, which installs it");
    String::from_utf8_lossy(&out.stdout).into_owned()
}
