//! The replay store as a server of its own, reached over the simulated network: the replay
//! server's `ReplayStore` is a client of it (one connection per operation, each bounded by a
//! timeout, as a Redis client's response timeout bounds its calls), and the store host keeps
//! its entries in a `MemoryStore`. A partition between the two, a held link or an injected
//! failure is a store that fails, and the replay layer has to answer for it.

use backstop::replay::{
    Claim, Fingerprint, MemoryStore, ReplayStore, StoreError, StoreFuture, StoredResponse, decode,
    encode,
};
use rand::{RngExt, SeedableRng, rngs::SmallRng};
use serde_json::{Value, json};
use std::{
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use turmoil::net::{TcpListener, TcpStream};

/// The store host's name and port.
pub(crate) const STORE: (&str, u16) = ("store", 6379);

/// How long the replay server waits for one store operation.
const OP_TIMEOUT: Duration = Duration::from_millis(150);

/// The replay server's view of the store: every operation a round trip to the store host.
#[derive(Debug, Default)]
pub(crate) struct RemoteStore;

async fn call(request: Value) -> Result<Value, StoreError> {
    let round_trip = async {
        let stream = TcpStream::connect(STORE).await?;
        let (read, mut write) = stream.into_split();
        let mut line = request.to_string();
        line.push('\n');
        write.write_all(line.as_bytes()).await?;
        let mut reply = String::new();
        BufReader::new(read).read_line(&mut reply).await?;
        Ok::<_, std::io::Error>(reply)
    };
    let reply = tokio::time::timeout(OP_TIMEOUT, round_trip)
        .await
        .map_err(|_| StoreError::new("the store did not answer in time"))?
        .map_err(|e| StoreError::new(format!("the store is unreachable: {e}")))?;
    let reply: Value = serde_json::from_str(&reply)
        .map_err(|e| StoreError::new(format!("the store's reply is unreadable: {e}")))?;
    match reply.get("error").and_then(Value::as_str) {
        Some(e) => Err(StoreError::new(e)),
        None => Ok(reply),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn fingerprint(v: &Value) -> Result<Fingerprint, StoreError> {
    v.as_str()
        .and_then(unhex)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| StoreError::new("a fingerprint that is not 32 bytes"))
}

fn flag(v: &Value) -> Result<bool, StoreError> {
    v.get("ok")
        .and_then(Value::as_bool)
        .ok_or_else(|| StoreError::new("a reply without its answer"))
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl ReplayStore for RemoteStore {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        fp: Fingerprint,
        lease: Duration,
    ) -> StoreFuture<'a, Claim> {
        Box::pin(async move {
            let r = call(json!({"op": "claim", "key": key, "fp": hex(&fp), "lease_ms": ms(lease)}))
                .await?;
            match r.get("claim").and_then(Value::as_str) {
                Some("claimed") => Ok(Claim::Claimed {
                    token: r["token"].as_u64().unwrap_or_default(),
                }),
                Some("in_flight") => Ok(Claim::InFlight {
                    fingerprint: fingerprint(&r["fp"])?,
                }),
                Some("done") => {
                    let bytes = r["response"].as_str().and_then(unhex).unwrap_or_default();
                    Ok(Claim::Done {
                        fingerprint: fingerprint(&r["fp"])?,
                        response: decode(&bytes)?,
                    })
                }
                _ => Err(StoreError::new("a claim reply the store should not send")),
            }
        })
    }

    fn renew<'a>(&'a self, key: &'a str, token: u64, lease: Duration) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            flag(
                &call(json!({"op": "renew", "key": key, "token": token, "lease_ms": ms(lease)}))
                    .await?,
            )
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
            let r = json!({"op": "complete", "key": key, "token": token,
                "response": hex(&encode(response)), "ttl_ms": ms(ttl)});
            flag(&call(r).await?)
        })
    }

    fn release<'a>(&'a self, key: &'a str, token: u64) -> StoreFuture<'a, bool> {
        Box::pin(
            async move { flag(&call(json!({"op": "release", "key": key, "token": token})).await?) },
        )
    }
}

/// One operation, served from the store host's `MemoryStore`.
async fn serve_op(store: &MemoryStore, req: &Value) -> Result<Value, StoreError> {
    let key = req["key"].as_str().unwrap_or_default();
    let token = req["token"].as_u64().unwrap_or_default();
    let millis = |name: &str| Duration::from_millis(req[name].as_u64().unwrap_or_default());
    Ok(match req["op"].as_str().unwrap_or_default() {
        "claim" => match store
            .claim(key, fingerprint(&req["fp"])?, millis("lease_ms"))
            .await?
        {
            Claim::Claimed { token } => json!({"claim": "claimed", "token": token}),
            Claim::InFlight { fingerprint } => {
                json!({"claim": "in_flight", "fp": hex(&fingerprint)})
            }
            Claim::Done {
                fingerprint,
                response,
            } => {
                json!({"claim": "done", "fp": hex(&fingerprint), "response": hex(&encode(&response))})
            }
        },
        "renew" => json!({"ok": store.renew(key, token, millis("lease_ms")).await?}),
        "complete" => {
            let bytes = req["response"].as_str().and_then(unhex).unwrap_or_default();
            let response = decode(&bytes)?;
            json!({"ok": store.complete(key, token, &response, millis("ttl_ms")).await?})
        }
        "release" => json!({"ok": store.release(key, token).await?}),
        other => return Err(StoreError::new(format!("no such operation: {other}"))),
    })
}

/// The store host's software: answers each connection's one operation, failing `fail_rate`
/// of them (drawn from a seeded RNG) without touching its entries, as a store that refuses
/// a command does.
pub(crate) async fn host(seed: u64, fail_rate: f64) -> turmoil::Result {
    let store = Arc::new(MemoryStore::new(100_000));
    let rng = Arc::new(Mutex::new(SmallRng::seed_from_u64(seed)));
    let listener = TcpListener::bind(("0.0.0.0", STORE.1)).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        let (store, rng) = (store.clone(), rng.clone());
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut line = String::new();
            if BufReader::new(read).read_line(&mut line).await.is_err() {
                return;
            }
            let fails = rng.lock().unwrap().random::<f64>() < fail_rate;
            let reply = match serde_json::from_str::<Value>(&line) {
                _ if fails => json!({"error": "the store refused the command (injected)"}),
                Ok(req) => serve_op(&store, &req)
                    .await
                    .unwrap_or_else(|e| json!({"error": e.to_string()})),
                Err(e) => json!({"error": format!("unreadable command: {e}")}),
            };
            let mut out = reply.to_string();
            out.push('\n');
            let _ = write.write_all(out.as_bytes()).await;
        });
    }
}
