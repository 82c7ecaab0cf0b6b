//! A TCP proxy in front of PostgreSQL that counts what its clients ask of the server, read off
//! the wire protocol's messages: round trips (each `Sync`, `Flush` or simple `Query`: the
//! messages after which a client waits for the server), executed statements (each `Execute`
//! or simple `Query`) and executed statements that write (`INSERT`, `UPDATE`, `DELETE`, or a
//! `WITH` that holds one: from `Parse`, `Bind` and `Execute`, or a simple `Query`).
//!
//! Round trips include what a pool spends on itself (a `Sync` to check a connection before it
//! is lent, the `Parse` of a statement on a connection that has not prepared it yet), which
//! depends on how many connections the pool opened and so on the machine's load. Executed
//! statements do not: count those when the claim is about the queries a client sends.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};

/// What the clients asked, counted since the start or the last [`PgWireCounter::reset`].
#[derive(Debug, Default)]
struct Counts {
    round_trips: AtomicU64,
    statements: AtomicU64,
    writes: AtomicU64,
}

/// The counting proxy, stopped when dropped.
#[derive(Debug)]
pub struct PgWireCounter {
    addr: SocketAddr,
    counts: Arc<Counts>,
    task: JoinHandle<()>,
}

impl Drop for PgWireCounter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PgWireCounter {
    /// A proxy on a free loopback port in front of the PostgreSQL server at `upstream`.
    pub async fn start(upstream: SocketAddr) -> PgWireCounter {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local address");
        let counts = Arc::new(Counts::default());
        let c = counts.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let c = c.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        relay(client, server, c).await;
                    }
                });
            }
        });
        PgWireCounter { addr, counts, task }
    }

    /// `url` (a `postgres://` URL of the upstream server) pointed at this proxy instead.
    pub fn url_for(&self, url: &str) -> String {
        let (head, rest) = url.rsplit_once(':').expect("a URL with a port");
        let path = rest.split_once('/').map_or("", |(_, p)| p);
        format!("{head}:{}/{path}", self.addr.port())
    }

    /// Round trips since the last reset.
    pub fn round_trips(&self) -> u64 {
        self.counts.round_trips.load(Ordering::SeqCst)
    }

    /// Statements executed (each `Execute` or simple `Query`), since the last reset: what a
    /// client asked, whatever its pool spent on connections (see the module docs).
    pub fn statements(&self) -> u64 {
        self.counts.statements.load(Ordering::SeqCst)
    }

    /// Executed statements that write, since the last reset.
    pub fn writes(&self) -> u64 {
        self.counts.writes.load(Ordering::SeqCst)
    }

    /// Starts counting again from zero.
    pub fn reset(&self) {
        self.counts.round_trips.store(0, Ordering::SeqCst);
        self.counts.statements.store(0, Ordering::SeqCst);
        self.counts.writes.store(0, Ordering::SeqCst);
    }
}

async fn relay(client: TcpStream, server: TcpStream, counts: Arc<Counts>) {
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let down = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
    });
    let mut reader = Frontend::default();
    let mut buf = vec![0u8; 16 * 1024];
    while let Ok(n) = from_client.read(&mut buf).await {
        if n == 0 {
            break;
        }
        let Fed {
            trips,
            statements,
            writes,
        } = reader.feed(&buf[..n]);
        counts.round_trips.fetch_add(trips, Ordering::SeqCst);
        counts.statements.fetch_add(statements, Ordering::SeqCst);
        counts.writes.fetch_add(writes, Ordering::SeqCst);
        if to_server.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    down.abort();
}

/// What one [`Frontend::feed`] completed.
#[derive(Default)]
struct Fed {
    trips: u64,
    statements: u64,
    writes: u64,
}

/// Reads the frontend's messages as they pass.
#[derive(Default)]
struct Frontend {
    pending: Vec<u8>,
    /// Past the startup message (which has no type byte).
    started: bool,
    /// Prepared statements by name: whether each writes.
    statements: HashMap<Vec<u8>, bool>,
    /// Whether the statement last bound writes.
    bound_writes: bool,
}

impl Frontend {
    /// Takes `bytes` in; returns the round trips, the statements executed and those that write
    /// in the messages completed.
    fn feed(&mut self, bytes: &[u8]) -> Fed {
        self.pending.extend_from_slice(bytes);
        let mut fed = Fed::default();
        loop {
            let header = if self.started { 5 } else { 4 };
            if self.pending.len() < header {
                break;
            }
            let len_at = usize::from(self.started);
            let len = u32::from_be_bytes(
                self.pending[len_at..len_at + 4]
                    .try_into()
                    .expect("four bytes"),
            ) as usize;
            let total = len_at + len;
            if self.pending.len() < total {
                break;
            }
            let message: Vec<u8> = self.pending.drain(..total).collect();
            if !self.started {
                // An SSL or GSS encryption request is followed by the real startup message.
                let code = message
                    .get(4..8)
                    .map(|c| u32::from_be_bytes(c.try_into().unwrap()));
                self.started = !matches!(code, Some(80_877_103 | 80_877_104));
                continue;
            }
            let body = &message[5..];
            match message[0] {
                b'P' => {
                    let mut parts = body.split(|b| *b == 0);
                    let name = parts.next().unwrap_or_default().to_vec();
                    let query = parts.next().unwrap_or_default();
                    self.statements.insert(name, is_write(query));
                }
                b'B' => {
                    let mut parts = body.split(|b| *b == 0);
                    let _portal = parts.next();
                    let statement = parts.next().unwrap_or_default();
                    self.bound_writes = self.statements.get(statement).copied().unwrap_or(false);
                }
                b'E' => {
                    fed.statements += 1;
                    fed.writes += u64::from(self.bound_writes);
                }
                b'Q' => {
                    fed.trips += 1;
                    fed.statements += 1;
                    fed.writes +=
                        u64::from(is_write(body.split(|b| *b == 0).next().unwrap_or_default()));
                }
                b'S' | b'H' => fed.trips += 1,
                _ => {}
            }
        }
        fed
    }
}

fn is_write(query: &[u8]) -> bool {
    let sql = String::from_utf8_lossy(query).to_ascii_uppercase();
    let sql = sql.trim_start();
    let writes = |s: &str| s.contains("INSERT ") || s.contains("UPDATE ") || s.contains("DELETE ");
    ["INSERT", "UPDATE", "DELETE"]
        .iter()
        .any(|w| sql.starts_with(w))
        || (sql.starts_with("WITH") && writes(sql))
}
