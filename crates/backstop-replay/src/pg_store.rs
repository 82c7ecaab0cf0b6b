//! A PostgreSQL store, and the transaction a handler shares with it.

use crate::store::{
    Claim, Fingerprint, ReplayStore, StoreError, StoreFuture, StoredResponse, decode, encode,
};
use sqlx::{
    PgConnection, PgPool, Postgres, Row, Transaction,
    postgres::{PgPoolOptions, PgRow},
};
use std::{fmt, sync::Arc, time::Duration};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};

fn err(e: sqlx::Error) -> StoreError {
    StoreError::with_source("the PostgreSQL store failed", e)
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64().max(0.001)
}

/// A PostgreSQL store: several replicas sharing one database deduplicate together, and a
/// handler can commit its own writes and the stored result in one transaction
/// ([`ReplayLayer::transactional`](crate::ReplayLayer::transactional)).
///
/// One row per key in `backstop_replay` (or the table you name): the state (`inflight` or
/// `done`), the fingerprint, the fencing token (from a sequence, so a newer claim always has a
/// higher token), the encoded response, and when the row expires (the lease while in flight,
/// the TTL once done). A claim is one statement (`INSERT .. ON CONFLICT .. DO UPDATE .. WHERE`
/// the row has expired, with the existing row read in the same statement): one round trip for a
/// first claim and for a replay. Times are the database's (`now()`), so replicas agree.
/// Expired rows are taken over by the next claim of their key and removed by
/// [`purge_expired`](Self::purge_expired).
#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
    sql: Arc<Sql>,
}

struct Sql {
    table: String,
    claim: String,
    renew: String,
    complete: String,
    release: String,
    purge: String,
}

impl fmt::Debug for PgStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgStore")
            .field("table", &self.sql.table)
            .finish()
    }
}

fn statements(table: &str) -> Sql {
    Sql {
        table: table.to_owned(),
        claim: format!(
            "WITH claimed AS (
               INSERT INTO {table} (key, fingerprint, state, token, response, expires_at)
               VALUES ($1, $2, 'inflight', nextval('{table}_tokens'), NULL,
                       now() + make_interval(secs => $3))
               ON CONFLICT (key) DO UPDATE
                 SET fingerprint = EXCLUDED.fingerprint, state = 'inflight',
                     token = EXCLUDED.token, response = NULL, expires_at = EXCLUDED.expires_at
                 WHERE {table}.expires_at <= now()
               RETURNING token
             )
             SELECT token, NULL::bytea AS fingerprint, NULL::text AS state, NULL::bytea AS response
               FROM claimed
             UNION ALL
             SELECT NULL, fingerprint, state, response FROM {table}
              WHERE key = $1 AND NOT EXISTS (SELECT 1 FROM claimed)"
        ),
        renew: format!(
            "UPDATE {table} SET expires_at = now() + make_interval(secs => $3)
              WHERE key = $1 AND state = 'inflight' AND token = $2"
        ),
        complete: format!(
            "UPDATE {table} SET state = 'done', response = $3, token = NULL,
                    expires_at = now() + make_interval(secs => $4)
              WHERE key = $1 AND state = 'inflight' AND token = $2"
        ),
        release: format!(
            "DELETE FROM {table} WHERE key = $1 AND state = 'inflight' AND token = $2"
        ),
        purge: format!("DELETE FROM {table} WHERE expires_at <= now()"),
    }
}

impl PgStore {
    /// Connects to `url` (`postgres://user@127.0.0.1:5432/db`) with a pool of up to 10
    /// connections and creates the table `backstop_replay` and its token sequence if they do
    /// not exist.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .acquire_timeout(Duration::from_secs(2))
            .connect(url)
            .await
            .map_err(err)?;
        Self::with_pool(pool, "backstop_replay").await
    }

    /// The store on an existing pool, in table `table` (lowercase letters, digits and `_`,
    /// starting with a letter), created if absent.
    pub async fn with_pool(pool: PgPool, table: &str) -> Result<Self, StoreError> {
        let valid = table.len() <= 50
            && table.starts_with(|c: char| c.is_ascii_lowercase())
            && table
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !valid {
            return Err(StoreError::new(format!(
                "postgres: the table name {table:?} must be lowercase letters, digits and _, \
                 starting with a letter, at most 50 characters"
            )));
        }
        let store = PgStore {
            pool,
            sql: Arc::new(statements(table)),
        };
        store.migrate().await?;
        Ok(store)
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        let table = &self.sql.table;
        let mut tx = self.pool.begin().await.map_err(err)?;
        // Two replicas starting at once must not race on CREATE.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(format!("backstop-replay-migrate:{table}"))
            .execute(&mut *tx)
            .await
            .map_err(err)?;
        for stmt in [
            format!(
                "CREATE TABLE IF NOT EXISTS {table} (
                   key text PRIMARY KEY,
                   fingerprint bytea NOT NULL,
                   state text NOT NULL CHECK (state IN ('inflight', 'done')),
                   token bigint,
                   response bytea,
                   expires_at timestamptz NOT NULL
                 )"
            ),
            format!("CREATE SEQUENCE IF NOT EXISTS {table}_tokens"),
            format!("CREATE INDEX IF NOT EXISTS {table}_expires ON {table} (expires_at)"),
        ] {
            sqlx::query(&stmt).execute(&mut *tx).await.map_err(err)?;
        }
        tx.commit().await.map_err(err)
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Deletes the rows that expired (results past their TTL, claims past their lease); returns
    /// how many. Run it now and then (an expired row is also reused by the next claim of its
    /// key, so nothing depends on it but the table's size).
    pub async fn purge_expired(&self) -> Result<u64, StoreError> {
        let done = sqlx::query(&self.sql.purge)
            .execute(&self.pool)
            .await
            .map_err(err)?;
        Ok(done.rows_affected())
    }

    /// Runs [`purge_expired`](Self::purge_expired) every `every` on the current runtime until the
    /// returned handle is dropped or aborted.
    pub fn purge_every(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if let Err(e) = store.purge_expired().await {
                    tracing::warn!(target: "backstop::replay", error = %backstop_core::plumbing::CauseChain(&e), "could not purge expired rows");
                }
            }
        })
    }

    /// Stores the response of the claim `token` inside `conn`'s transaction: it becomes visible
    /// (and the key done) only when that transaction commits, together with whatever else the
    /// handler wrote in it. `false` when the claim is no longer this token's.
    pub(crate) async fn complete_in(
        &self,
        conn: &mut PgConnection,
        key: &str,
        token: u64,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(&self.sql.complete)
            .bind(key)
            .bind(token_i64(token)?)
            .bind(encode(response))
            .bind(secs(ttl))
            .execute(conn)
            .await
            .map_err(err)?;
        Ok(done.rows_affected() == 1)
    }

    pub(crate) async fn begin(&self) -> Result<Transaction<'static, Postgres>, StoreError> {
        self.pool.begin().await.map_err(err)
    }

    async fn claim_once(
        &self,
        key: &str,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> Result<Option<Claim>, StoreError> {
        let row: Option<PgRow> = sqlx::query(&self.sql.claim)
            .bind(key)
            .bind(&fingerprint[..])
            .bind(secs(lease))
            .fetch_optional(&self.pool)
            .await
            .map_err(err)?;
        let Some(row) = row else {
            return Ok(None);
        };
        let token: Option<i64> = row.try_get("token").map_err(err)?;
        if let Some(t) = token {
            return Ok(Some(Claim::Claimed {
                token: u64::try_from(t)
                    .map_err(|_| StoreError::new("postgres: a negative token"))?,
            }));
        }
        let fp: Vec<u8> = row.try_get("fingerprint").map_err(err)?;
        let fingerprint: Fingerprint = fp
            .try_into()
            .map_err(|_| StoreError::new("postgres: a stored fingerprint is malformed"))?;
        let state: String = row.try_get("state").map_err(err)?;
        match state.as_str() {
            "inflight" => Ok(Some(Claim::InFlight { fingerprint })),
            "done" => {
                let bytes: Option<Vec<u8>> = row.try_get("response").map_err(err)?;
                let bytes = bytes
                    .ok_or_else(|| StoreError::new("postgres: a stored response is missing"))?;
                Ok(Some(Claim::Done {
                    fingerprint,
                    response: decode(&bytes)?,
                }))
            }
            other => Err(StoreError::new(format!(
                "postgres: unknown state {other:?}"
            ))),
        }
    }

    async fn owned(
        &self,
        sql: &str,
        key: &str,
        token: u64,
        arg: Option<f64>,
    ) -> Result<bool, StoreError> {
        let mut q = sqlx::query(sql).bind(key).bind(token_i64(token)?);
        if let Some(a) = arg {
            q = q.bind(a);
        }
        let done = q.execute(&self.pool).await.map_err(err)?;
        Ok(done.rows_affected() == 1)
    }
}

fn token_i64(token: u64) -> Result<i64, StoreError> {
    i64::try_from(token).map_err(|_| StoreError::new("postgres: a token out of range"))
}

impl ReplayStore for PgStore {
    fn claim<'a>(
        &'a self,
        key: &'a str,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> StoreFuture<'a, Claim> {
        Box::pin(async move {
            // An empty answer means the row changed between the statement's insert and its
            // read (another claim committed in between): ask again.
            for _ in 0..3 {
                if let Some(c) = self.claim_once(key, fingerprint, lease).await? {
                    return Ok(c);
                }
            }
            Err(StoreError::new(
                "postgres: the key kept changing during the claim",
            ))
        })
    }

    fn renew<'a>(&'a self, key: &'a str, token: u64, lease: Duration) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            self.owned(&self.sql.renew, key, token, Some(secs(lease)))
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
            let mut conn = self.pool.acquire().await.map_err(err)?;
            self.complete_in(&mut conn, key, token, response, ttl).await
        })
    }

    fn release<'a>(&'a self, key: &'a str, token: u64) -> StoreFuture<'a, bool> {
        Box::pin(async move { self.owned(&self.sql.release, key, token, None).await })
    }
}

/// The open transaction of a request served by a transactional replay layer
/// ([`ReplayLayer::transactional`](crate::ReplayLayer::transactional)), in the request's
/// extensions (and, with the `axum` feature, an axum extractor).
///
/// The handler writes its business rows through it; the layer then writes the stored response
/// in the same transaction and commits both, so a crash between the effect and the record
/// leaves neither. Do not commit or roll back yourself: answer with an error status instead,
/// and the layer rolls back.
///
/// ```no_run
/// use backstop_replay::{PgTransaction, ReplayRequestBody};
///
/// async fn book_refund(req: http::Request<ReplayRequestBody>) -> Result<(), sqlx::Error> {
///     let tx = req.extensions().get::<PgTransaction>().expect("a transactional layer");
///     let mut conn = tx.lock().await;
///     sqlx::query("INSERT INTO refunds (order_id, amount) VALUES ($1, $2)")
///         .bind("A-7")
///         .bind(49_i64)
///         .execute(&mut *conn)
///         .await?;
///     Ok(())
/// }
/// ```
#[derive(Clone)]
pub struct PgTransaction {
    tx: Arc<Mutex<Option<Transaction<'static, Postgres>>>>,
}

impl fmt::Debug for PgTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTransaction").finish_non_exhaustive()
    }
}

impl PgTransaction {
    pub(crate) fn new(tx: Transaction<'static, Postgres>) -> Self {
        PgTransaction {
            tx: Arc::new(Mutex::new(Some(tx))),
        }
    }

    /// The transaction's connection, for `sqlx::query(..).execute(&mut *conn)`.
    ///
    /// # Panics
    ///
    /// When called after the handler answered (the layer has taken the transaction to commit
    /// it).
    pub async fn lock(&self) -> MappedMutexGuard<'_, PgConnection> {
        MutexGuard::map(self.tx.lock().await, |t| {
            &mut **t
                .as_mut()
                .expect("the transaction is used after the handler answered")
        })
    }

    /// Takes the transaction back, once the handler has answered.
    pub(crate) async fn take(&self) -> Option<Transaction<'static, Postgres>> {
        self.tx.lock().await.take()
    }
}

/// In an axum handler behind a transactional replay layer: `async fn refund(tx: PgTransaction,
/// body: String) -> ..`. Outside one, the request is refused with 500 (the server is
/// misconfigured).
#[cfg(feature = "axum")]
impl<S: Send + Sync> axum_core::extract::FromRequestParts<S> for PgTransaction {
    type Rejection = (http::StatusCode, &'static str);

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<PgTransaction>().cloned().ok_or((
            http::StatusCode::INTERNAL_SERVER_ERROR,
            "the server is misconfigured: this handler needs the transaction of a transactional \
             replay layer (ReplayLayer::transactional) in front of it",
        ))
    }
}
