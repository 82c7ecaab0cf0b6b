//! A Redis Cluster of the test's own: persistent nodes on free loopback ports, joined with
//! `redis-cli --cluster create`, stopped when dropped.

use crate::RedisServer;
use std::{process::Command, time::Duration};

/// A Redis Cluster of `n` primaries (no replicas) on loopback, each node persistent
/// (`appendonly yes`, `appendfsync always`), so a node killed and restarted keeps its keys.
///
/// Needs `redis-server` and `redis-cli` on the `PATH` (Debian's `redis-server` package brings
/// both).
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `n` nodes (at least three: Redis Cluster's minimum of primaries), joins them and
    /// waits until every node reports `cluster_state:ok`.
    pub async fn start(n: usize) -> RedisCluster {
        assert!(n >= 3, "a Redis Cluster needs at least three primaries");
        let mut nodes = Vec::with_capacity(n);
        for _ in 0..n {
            nodes.push(RedisServer::start_cluster_node().await);
        }
        let cluster = RedisCluster { nodes };
        let addresses: Vec<String> = cluster
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli must be installed to run the Redis Cluster tests: `apt-get install redis-tools` (Debian, Ubuntu), or run `scripts/test`, which installs it");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for i in 0..n {
            cluster.wait_ok(i).await;
        }
        cluster
    }

    /// The nodes' URLs, `redis://127.0.0.1:PORT/`.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// How many keys node `i` holds (`DBSIZE`).
    pub fn keys_on(&self, i: usize) -> u64 {
        self.cli(i, &["DBSIZE"]).trim().parse().unwrap_or(0)
    }

    /// Kills node `i` (`SIGKILL`).
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// Starts node `i` again on its port, with its data and its cluster configuration, and
    /// waits until every node reports the cluster healthy again.
    pub async fn restart(&mut self, i: usize) {
        self.nodes[i].restart().await;
        for j in 0..self.nodes.len() {
            self.wait_ok(j).await;
        }
    }

    fn cli(&self, i: usize, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.nodes[i].port().to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    async fn wait_ok(&self, i: usize) {
        for _ in 0..400 {
            if self
                .cli(i, &["CLUSTER", "INFO"])
                .contains("cluster_state:ok")
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("Redis Cluster node {i} did not report cluster_state:ok within 10 s");
    }
}
