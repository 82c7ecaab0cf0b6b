use crate::store::{
    Claim, Fingerprint, ReplayStore, StoreError, StoreFuture, StoredResponse, decode, encode,
};
use redis::{
    AsyncConnectionConfig, Client, FromRedisValue, RedisResult, Script, ScriptInvocation, Value,
    aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection},
    cluster::{ClusterClientBuilder, ClusterConfig},
    cluster_async::ClusterConnection,
    sentinel::{SentinelClient, SentinelServerType},
};
use std::{fmt, sync::Arc, time::Duration};
use tokio::sync::Mutex;

// The token is the server's clock in microseconds: a key is claimed again only once its last
// claim is gone (released, or its lease ran out on this same clock), so a newer claim of a key
// has a larger token while the server's clock does not go back.
const CLAIM: &str = r"
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  local now = redis.call('TIME')
  local token = now[1] .. string.format('%06d', tonumber(now[2]))
  redis.call('HSET', KEYS[1], 'state', 'inflight', 'fp', ARGV[1], 'token', token)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, token}
end
if state == 'inflight' then
  return {2, redis.call('HGET', KEYS[1], 'fp')}
end
return {3, redis.call('HGET', KEYS[1], 'fp'), redis.call('HGET', KEYS[1], 'response')}
";

const OWNED: &str = "redis.call('HGET', KEYS[1], 'state') == 'inflight' and redis.call('HGET', KEYS[1], 'token') == ARGV[1]";

fn owned_script(body: &str) -> Script {
    Script::new(&format!("if {OWNED} then\n{body}\nreturn 1\nend\nreturn 0"))
}

/// A Redis store: several server replicas sharing one Redis, or one Redis Cluster, deduplicate
/// together.
///
/// Each key is one hash, `<prefix><hashed key>`, holding the state, the fingerprint, the fencing
/// token and, once done, the encoded response; its expiry is the lease while in flight and the
/// TTL once done. Claim, renew, complete and release are Lua scripts, so each is atomic, and
/// every script touches one key: on a cluster ([`cluster`](Self::cluster)) the key's hash slot
/// picks the node that runs it, and a key's whole life stays on that node. A claim's token is
/// the server's clock in microseconds when it claimed (`TIME`, inside the claim's script): a
/// newer claim of a key always has a larger token while that clock does not go back, so a
/// handler's own database can refuse a write whose [`Lease::token`](crate::Lease::token) is
/// lower than one it has seen (a node's clock stepped back, or a failover to a replica whose
/// clock is behind, breaks that order: it is the store's clock the leases are measured by too).
///
/// On one Redis the connection is a `ConnectionManager`, on a cluster redis-rs's cluster
/// connection (which follows the cluster's slot map, `MOVED` and `ASK`); either reconnects by
/// itself once a node comes back. While the node that holds a key is unreachable every
/// operation on that key fails (after at most the connection and response timeouts, 1 s each),
/// and the replay layer answers 503 instead of running a request it cannot protect; keys on the
/// other nodes go on.
///
/// **What a failover can lose.** Redis replicates asynchronously: a write acknowledged by a
/// primary that dies before its replica received it is gone once the replica is promoted. For
/// this store that is a claim (the request may then run twice, once on each side of the
/// failover) or a stored result (a repeat runs again). Each node needs `appendonly yes` with
/// `appendfsync always` to keep its own writes across its own crash (`everysec` can lose the
/// last second); `min-replicas-to-write 1` makes a primary refuse writes it cannot replicate,
/// which narrows the window but does not close it (the replica's acknowledgement is itself
/// asynchronous). For exactly-once across a failover, use the PostgreSQL store.
///
/// ```no_run
/// use backstop_replay::{OnVolatile, RedisStore, ReplayLayer};
///
/// # async fn run() -> Result<(), backstop_replay::StoreError> {
/// // Refuses a Redis that keeps nothing on disk: a restart would forget which keys ran.
/// let store = RedisStore::connect("redis://127.0.0.1:6379/", OnVolatile::Refuse).await?;
/// let layer = ReplayLayer::new(store).single_tenant();
/// # let _ = layer; Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    prefix: String,
    claim: Script,
    renew: Script,
    complete: Script,
    release: Script,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish()
    }
}

/// One Redis, a cluster, or the primary that Sentinel names.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(Arc<Primary>),
}

impl Conn {
    async fn invoke<T: FromRedisValue>(&self, inv: &ScriptInvocation<'_>) -> RedisResult<T> {
        match self {
            Conn::Single(c) => inv.invoke_async(&mut c.clone()).await,
            Conn::Cluster(c) => inv.invoke_async(&mut c.clone()).await,
            Conn::Sentinel(p) => {
                let mut c = p.connection().await?;
                p.judge(inv.invoke_async(&mut c).await).await
            }
        }
    }

    async fn query<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> RedisResult<T> {
        match self {
            Conn::Single(c) => cmd.query_async(&mut c.clone()).await,
            Conn::Cluster(c) => cmd.query_async(&mut c.clone()).await,
            Conn::Sentinel(p) => {
                let mut c = p.connection().await?;
                p.judge(cmd.query_async(&mut c).await).await
            }
        }
    }
}

/// The primary Sentinel names, and a connection to it until it fails: then Sentinel is asked
/// again, so after a failover the next operation goes to the promoted replica.
struct Primary {
    sentinel: Mutex<SentinelClient>,
    current: Mutex<Option<MultiplexedConnection>>,
}

impl Primary {
    async fn connection(&self) -> RedisResult<MultiplexedConnection> {
        let mut current = self.current.lock().await;
        if let Some(c) = &*current {
            return Ok(c.clone());
        }
        let client = self.sentinel.lock().await.async_get_client().await?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(1)));
        let c = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        *current = Some(c.clone());
        Ok(c)
    }

    /// A result as it is; a connection that failed, or a node that is no longer the primary
    /// (`READONLY`: a demoted primary), is forgotten, so the next operation asks Sentinel.
    async fn judge<T>(&self, result: RedisResult<T>) -> RedisResult<T> {
        if let Err(e) = &result
            && (e.is_io_error()
                || e.is_timeout()
                || e.is_connection_dropped()
                || e.is_unrecoverable_error()
                || e.code() == Some("READONLY"))
        {
            *self.current.lock().await = None;
        }
        result
    }
}

fn err(e: redis::RedisError) -> StoreError {
    StoreError::with_source("the Redis store failed", e)
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl RedisStore {
    /// A store on the Redis at `url` (`redis://127.0.0.1:6379/`), key prefix `backstop:replay:`.
    /// Connects lazily, on first use, so a server can start before its Redis.
    pub fn open(url: &str) -> Result<Self, StoreError> {
        let client = Client::open(url).map_err(err)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(1)))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(200));
        let conn = ConnectionManager::new_lazy_with_config(client, config).map_err(err)?;
        Ok(Self::over(Conn::Single(conn)))
    }

    /// A store on the Redis Cluster that `nodes` belong to (`redis://127.0.0.1:7000/`, ...:
    /// any of its nodes, from which the rest and the slot map are learned), key prefix
    /// `backstop:replay:`. Connects lazily, on first use, like [`open`](Self::open).
    pub fn cluster<N: AsRef<str>>(nodes: &[N]) -> Result<Self, StoreError> {
        if nodes.is_empty() {
            return Err(StoreError::new(
                "redis: a cluster store needs the address of at least one of its nodes",
            ));
        }
        let nodes: Vec<&str> = nodes.iter().map(AsRef::as_ref).collect();
        let client = ClusterClientBuilder::new(nodes)
            .connection_timeout(Duration::from_secs(1))
            .response_timeout(Duration::from_secs(1))
            .retries(1)
            .build()
            .map_err(err)?;
        let config = ClusterConfig::new()
            .set_connection_timeout(Duration::from_secs(1))
            .set_response_timeout(Duration::from_secs(1));
        let conn = client.get_pending_async_connection_with_config(config);
        Ok(Self::over(Conn::Cluster(conn)))
    }

    /// [`cluster`](Self::cluster), checked as [`connect`](Self::connect) checks one Redis:
    /// every node named in `nodes` must keep its data across a restart.
    pub async fn connect_cluster<N: AsRef<str>>(
        nodes: &[N],
        on_volatile: OnVolatile,
    ) -> Result<Self, StoreError> {
        let store = Self::cluster(nodes)?;
        for node in nodes {
            let node = node.as_ref();
            let persistence = Self::open(node)?.persistence().await?;
            Self::judge(persistence, on_volatile).map_err(|e| {
                StoreError::with_source(format!("Redis cluster node {node} failed"), e)
            })?;
        }
        Ok(store)
    }

    /// A store on the primary that the Redis Sentinels at `sentinels` (`redis://127.0.0.1:26379/`,
    /// ...) monitor as `primary`, key prefix `backstop:replay:`. The primary is asked of
    /// Sentinel on first use and again whenever its connection fails or it answers as a replica
    /// (`READONLY`), so after a failover the store follows the promoted replica; while there is
    /// no primary, operations fail and the replay layer answers 503. A failover can lose what
    /// the old primary acknowledged and had not replicated (see the type's docs).
    pub fn sentinel<N: AsRef<str>>(sentinels: &[N], primary: &str) -> Result<Self, StoreError> {
        let sentinels: Vec<&str> = sentinels.iter().map(AsRef::as_ref).collect();
        if sentinels.is_empty() {
            return Err(StoreError::new(
                "redis: a Sentinel store needs the address of at least one Sentinel",
            ));
        }
        let client = SentinelClient::build(
            sentinels,
            primary.to_owned(),
            None,
            SentinelServerType::Master,
        )
        .map_err(err)?;
        Ok(Self::over(Conn::Sentinel(Arc::new(Primary {
            sentinel: Mutex::new(client),
            current: Mutex::new(None),
        }))))
    }

    fn over(conn: Conn) -> Self {
        RedisStore {
            conn,
            prefix: "backstop:replay:".to_owned(),
            claim: Script::new(CLAIM),
            renew: owned_script("redis.call('PEXPIRE', KEYS[1], ARGV[2])"),
            complete: owned_script(
                "redis.call('HSET', KEYS[1], 'state', 'done', 'response', ARGV[2])\n\
                 redis.call('HDEL', KEYS[1], 'token')\n\
                 redis.call('PEXPIRE', KEYS[1], ARGV[3])",
            ),
            release: owned_script("redis.call('DEL', KEYS[1])"),
        }
    }

    /// Opens the store and checks that the server keeps its data across a restart (an
    /// append-only file or RDB snapshots). A Redis that restarts empty forgets every claim and
    /// result, so requests repeated after the restart run again: with [`OnVolatile::Refuse`]
    /// such a server is an error, with [`OnVolatile::Warn`] a warning (`backstop::replay`). A
    /// server that does not answer `CONFIG GET` (a managed Redis may forbid it) is warned
    /// about and accepted either way: its persistence is the operator's to confirm.
    pub async fn connect(url: &str, on_volatile: OnVolatile) -> Result<Self, StoreError> {
        let store = Self::open(url)?;
        Self::judge(store.persistence().await?, on_volatile)?;
        Ok(store)
    }

    /// What `on_volatile` makes of a server's persistence.
    fn judge(persistence: Persistence, on_volatile: OnVolatile) -> Result<(), StoreError> {
        match persistence {
            Persistence::None => {
                let why = "this Redis keeps nothing on disk (appendonly no, no save points): if it \
                           restarts, every claim and stored result is lost and repeated requests \
                           run again; turn on AOF (appendonly yes) or RDB snapshots";
                match on_volatile {
                    OnVolatile::Refuse => return Err(StoreError::new(format!("redis: {why}"))),
                    OnVolatile::Warn => tracing::warn!(target: "backstop::replay", "{why}"),
                }
            }
            Persistence::Unknown(e) => tracing::warn!(
                target: "backstop::replay",
                error = %e,
                "could not read this Redis's persistence settings; make sure it keeps its data across restarts"
            ),
            Persistence::Aof | Persistence::Rdb => {}
        }
        Ok(())
    }

    /// What the server keeps across a restart, from `CONFIG GET appendonly` and `CONFIG GET
    /// save`. An unreachable server is an error; a refused `CONFIG` is
    /// [`Persistence::Unknown`].
    pub async fn persistence(&self) -> Result<Persistence, StoreError> {
        let aof: RedisResult<Vec<String>> = self
            .conn
            .query(redis::cmd("CONFIG").arg("GET").arg("appendonly"))
            .await;
        let aof = match aof {
            Ok(v) => v,
            Err(e) if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() => {
                return Err(err(e));
            }
            Err(e) => return Ok(Persistence::Unknown(e.to_string())),
        };
        if aof.get(1).is_some_and(|v| v == "yes") {
            return Ok(Persistence::Aof);
        }
        let save: Vec<String> = match self
            .conn
            .query(redis::cmd("CONFIG").arg("GET").arg("save"))
            .await
        {
            Ok(v) => v,
            Err(e) => return Ok(Persistence::Unknown(e.to_string())),
        };
        Ok(if save.get(1).is_some_and(|v| !v.trim().is_empty()) {
            Persistence::Rdb
        } else {
            Persistence::None
        })
    }

    /// The key prefix.
    #[must_use]
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    async fn owned(&self, script: &Script, key: &str, args: &[&[u8]]) -> Result<bool, StoreError> {
        let mut inv = script.key(self.key(key));
        for a in args {
            inv.arg(*a);
        }
        let n: i64 = self.conn.invoke(&inv).await.map_err(err)?;
        Ok(n == 1)
    }
}

/// What a Redis server keeps across a restart.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Persistence {
    /// An append-only file (`appendonly yes`).
    Aof,
    /// RDB snapshots only (`save` points): writes since the last snapshot are lost on a crash.
    Rdb,
    /// Nothing: a restart empties it.
    None,
    /// The server would not say (`CONFIG` refused), with its answer.
    Unknown(String),
}

/// What [`RedisStore::connect`] does with a server that keeps nothing on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnVolatile {
    /// Log a warning and use it.
    Warn,
    /// Refuse it: `connect` fails.
    Refuse,
}

fn bytes(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        _ => None,
    }
}

fn parse_fp(v: Option<&Value>) -> Result<Fingerprint, StoreError> {
    v.and_then(bytes)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| StoreError::new("redis: a stored fingerprint is malformed"))
}

impl ReplayStore for RedisStore {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> StoreFuture<'a, Claim> {
        Box::pin(async move {
            let mut inv = self.claim.key(self.key(key));
            inv.arg(&fingerprint[..]).arg(ms(lease));
            let reply: Vec<Value> = self.conn.invoke(&inv).await.map_err(err)?;
            match reply.first() {
                Some(Value::Int(1)) => Ok(Claim::Claimed {
                    token: reply
                        .get(1)
                        .and_then(bytes)
                        .and_then(|b| std::str::from_utf8(b).ok()?.parse().ok())
                        .ok_or_else(|| StoreError::new("redis: a claim without its token"))?,
                }),
                Some(Value::Int(2)) => Ok(Claim::InFlight {
                    fingerprint: parse_fp(reply.get(1))?,
                }),
                Some(Value::Int(3)) => {
                    let response = reply
                        .get(2)
                        .and_then(bytes)
                        .ok_or_else(|| StoreError::new("redis: a stored response is missing"))?;
                    Ok(Claim::Done {
                        fingerprint: parse_fp(reply.get(1))?,
                        response: decode(response)?,
                    })
                }
                _ => Err(StoreError::new("redis: unexpected reply to a claim")),
            }
        })
    }

    fn renew<'a>(&'a self, key: &'a str, token: u64, lease: Duration) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let (t, l) = (token.to_string(), ms(lease).to_string());
            self.owned(&self.renew, key, &[t.as_bytes(), l.as_bytes()])
                .await
        })
    }

    fn complete<'a>(
        &'a self,
        key: &'a str,
        token: u64,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let (t, ttl) = (token.to_string(), ms(ttl).to_string());
            let encoded = encode(response);
            self.owned(
                &self.complete,
                key,
                &[t.as_bytes(), &encoded, ttl.as_bytes()],
            )
            .await
        })
    }

    fn release<'a>(&'a self, key: &'a str, token: u64) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let t = token.to_string();
            self.owned(&self.release, key, &[t.as_bytes()]).await
        })
    }
}
