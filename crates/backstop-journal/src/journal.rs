//! The journal: one SQL schema on SQLite (embedded) or PostgreSQL (shared), every transition
//! written in a transaction with its history row, compare-and-set on the state so that two
//! workers never both move a step.

use crate::model::{NewStep, Resolution, Step, StepId, StepState, StepTransition};
use std::{
    fmt,
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// What identifies a call a step makes: its tool and its arguments' digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallIdentity {
    /// The tool (or dependency) called.
    pub tool: String,
    /// The digest of its arguments ([`digest`](crate::digest)).
    pub args_digest: String,
}

/// Why a journal operation failed. Nothing is half-written: each operation is one transaction.
#[derive(Debug)]
#[non_exhaustive]
pub enum JournalError {
    /// The database could not be reached or refused the statement.
    Store(String),
    /// The step is not where the caller expected (another worker moved it, or the move is not
    /// allowed): nothing was written.
    Conflict {
        /// The step.
        id: StepId,
        /// Where the caller expected it.
        expected: Vec<StepState>,
        /// Where it is (`None`: not recorded).
        found: Option<StepState>,
        /// The move asked for.
        to: StepState,
    },
    /// A step with these ids was recorded for another call (another tool, or other
    /// arguments): the new call is refused, and nothing is sent.
    ArgsChanged {
        /// The step.
        id: StepId,
        /// The recorded call.
        recorded: Box<CallIdentity>,
        /// The refused call.
        refused: Box<CallIdentity>,
    },
    /// The step's outcome is unknown: it must be reconciled before anything sends it again.
    NeedsReconciliation(Box<Step>),
    /// No such run or step.
    NotFound(String),
    /// The step is over already: it was not sent again (its stored result is in the step).
    AlreadyDone(Box<Step>),
    /// The step is parked until its time: it was not sent.
    Parked(Box<Step>),
    /// The run cannot do what was asked (it is over, it was started as another workflow, or
    /// another worker holds it): nothing was written.
    RunRefused {
        /// The run.
        run: String,
        /// Why, in words.
        why: String,
    },
}

impl fmt::Display for JournalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JournalError::Store(e) => write!(f, "the journal's database failed: {e}"),
            JournalError::Conflict {
                id,
                expected,
                found,
                to,
            } => {
                let expected: Vec<_> = expected.iter().map(|s| s.as_str()).collect();
                match found {
                    Some(found) => write!(
                        f,
                        "step {id} is {found}, not {}: it was not moved to {to}",
                        expected.join(" or ")
                    ),
                    None => write!(
                        f,
                        "step {id} is not in the journal: it was not moved to {to}"
                    ),
                }
            }
            JournalError::ArgsChanged {
                id,
                recorded,
                refused,
            } => write!(
                f,
                "step {id} was recorded for a call to {} with arguments {}, and this call to {} \
                 has arguments {}: a different call cannot reuse a step's ids (it was not sent)",
                recorded.tool,
                short(&recorded.args_digest),
                refused.tool,
                short(&refused.args_digest)
            ),
            JournalError::NeedsReconciliation(step) => write!(
                f,
                "step {} was sent and its outcome is unknown ({}): reconcile it before sending it again",
                step.id, step.state
            ),
            JournalError::NotFound(what) => write!(f, "{what} is not in the journal"),
            JournalError::AlreadyDone(step) => write!(
                f,
                "step {} is already {} (the journal has its result): it was not sent again",
                step.id, step.state
            ),
            JournalError::Parked(step) => write!(
                f,
                "step {} is parked until {} ms since the epoch (its dependency asked to wait): it was not sent",
                step.id,
                step.park_until.unwrap_or_default()
            ),
            JournalError::RunRefused { run, why } => write!(f, "run {run}: {why}"),
        }
    }
}

impl std::error::Error for JournalError {}

/// A digest as shown in words: its first 12 characters.
fn short(digest: &str) -> String {
    match digest.get(..12) {
        Some(head) if digest.len() > 12 => format!("{head}…"),
        _ => digest.to_owned(),
    }
}

impl From<sqlx::Error> for JournalError {
    fn from(e: sqlx::Error) -> Self {
        JournalError::Store(e.to_string())
    }
}

/// The time the journal writes, in milliseconds since the Unix epoch (replaceable for tests).
pub type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

fn system_clock() -> Clock {
    Arc::new(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
    })
}

#[derive(Clone)]
pub(crate) enum Backend {
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::SqlitePool),
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
}

/// Runs `$body` with `$pool` bound to whichever pool the journal has (the body is compiled
/// once per backend).
macro_rules! with_pool {
    ($self:expr, |$pool:ident, $sql:ident| $body:expr) => {
        match &$self.backend {
            #[cfg(feature = "sqlite")]
            $crate::journal::Backend::Sqlite($pool) => {
                let $sql = |s: &str| to_sqlite(s);
                $body
            }
            #[cfg(feature = "postgres")]
            $crate::journal::Backend::Postgres($pool) => {
                let $sql = |s: &str| s.to_owned();
                $body
            }
        }
    };
}
pub(crate) use with_pool;

/// SQLite's positional parameters are `?N`; the statements are written with PostgreSQL's `$N`.
#[cfg(feature = "sqlite")]
pub(crate) fn to_sqlite(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '$' && chars.peek().is_some_and(char::is_ascii_digit) {
            out.push('?');
        } else {
            out.push(c);
        }
    }
    out
}

/// The durable step journal, on SQLite or PostgreSQL. Cheap to clone (a pool).
#[derive(Clone)]
pub struct Journal {
    pub(crate) backend: Backend,
    /// The connections a step's two writes use, on PostgreSQL.
    #[cfg(feature = "postgres")]
    pub(crate) step_conns: Option<Arc<crate::step_conns::StepConnections>>,
    clock: Clock,
}

impl fmt::Debug for Journal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Journal")
            .field("store", &self.store_name())
            .finish_non_exhaustive()
    }
}

pub(crate) const STEP_COLUMNS: &str = "run_id, step_id, call_id, tool, idem_key, args_digest, kind, state, \
     attempts, last_error, result, provider_ref, park_until, attention, created_ms, updated_ms, sent_ms";

/// The schema, version by version; each backend's DDL differs only in the id column.
fn migrations(serial: &str) -> Vec<(i64, String)> {
    vec![
        (
            1,
            format!(
                "CREATE TABLE IF NOT EXISTS backstop_journal_steps (
                run_id TEXT NOT NULL, step_id TEXT NOT NULL, call_id TEXT NOT NULL,
                tool TEXT NOT NULL, idem_key TEXT NOT NULL, args_digest TEXT NOT NULL,
                kind TEXT NOT NULL, state TEXT NOT NULL, attempts BIGINT NOT NULL,
                last_error TEXT, result TEXT, provider_ref TEXT, park_until BIGINT,
                attention TEXT, created_ms BIGINT NOT NULL, updated_ms BIGINT NOT NULL,
                sent_ms BIGINT,
                PRIMARY KEY (run_id, step_id, call_id));
             CREATE INDEX IF NOT EXISTS backstop_journal_steps_state
                ON backstop_journal_steps (state);
             CREATE TABLE IF NOT EXISTS backstop_journal_transitions (
                id {serial}, run_id TEXT NOT NULL, step_id TEXT NOT NULL, call_id TEXT NOT NULL,
                from_state TEXT, to_state TEXT NOT NULL, at_ms BIGINT NOT NULL,
                attempts BIGINT NOT NULL, error TEXT, actor TEXT NOT NULL, reason TEXT);
             CREATE INDEX IF NOT EXISTS backstop_journal_transitions_step
                ON backstop_journal_transitions (run_id, step_id, call_id, id);
             CREATE TABLE IF NOT EXISTS backstop_journal_runs (
                run_id TEXT PRIMARY KEY, created_ms BIGINT NOT NULL, updated_ms BIGINT NOT NULL,
                claimed_by TEXT, claim_until BIGINT);"
            ),
        ),
        (
            2,
            format!(
                "ALTER TABLE backstop_journal_runs ADD COLUMN workflow TEXT;
             ALTER TABLE backstop_journal_runs ADD COLUMN input TEXT;
             ALTER TABLE backstop_journal_runs ADD COLUMN state TEXT NOT NULL DEFAULT 'pending';
             ALTER TABLE backstop_journal_runs ADD COLUMN output TEXT;
             ALTER TABLE backstop_journal_runs ADD COLUMN error TEXT;
             ALTER TABLE backstop_journal_runs ADD COLUMN wake_ms BIGINT;
             CREATE INDEX IF NOT EXISTS backstop_journal_runs_state
                ON backstop_journal_runs (state, claim_until);
             CREATE TABLE IF NOT EXISTS backstop_journal_run_events (
                id {serial}, run_id TEXT NOT NULL, at_ms BIGINT NOT NULL, actor TEXT NOT NULL,
                action TEXT NOT NULL, reason TEXT);
             CREATE INDEX IF NOT EXISTS backstop_journal_run_events_run
                ON backstop_journal_run_events (run_id, id)"
            ),
        ),
    ]
}

/// What a transition writes besides the state.
#[derive(Clone, Debug, Default)]
pub struct Change {
    /// Count one more attempt.
    pub attempt: bool,
    /// The error that caused it.
    pub error: Option<String>,
    /// The result to store.
    pub result: Option<String>,
    /// The provider's reference.
    pub provider_ref: Option<String>,
    /// When a parked step wakes.
    pub park_until: Option<i64>,
    /// Why it needs a person (cleared when `None`).
    pub attention: Option<String>,
    /// Who: `journal` unless an operator.
    pub actor: Option<String>,
    /// Why, in words.
    pub reason: Option<String>,
}

impl Change {
    /// One more attempt, nothing else: what a move to `sent` writes.
    pub fn attempt() -> Self {
        Change {
            attempt: true,
            ..Change::default()
        }
    }
}

macro_rules! step_from_row {
    ($row:expr) => {{
        use sqlx::Row;
        let row = $row;
        let state: String = row.try_get("state")?;
        let kind: String = row.try_get("kind")?;
        let attempts: i64 = row.try_get("attempts")?;
        $crate::model::Step {
            id: $crate::model::StepId::new(
                &row.try_get::<String, _>("run_id")?,
                &row.try_get::<String, _>("step_id")?,
                &row.try_get::<String, _>("call_id")?,
            ),
            tool: row.try_get("tool")?,
            key: row.try_get("idem_key")?,
            args_digest: row.try_get("args_digest")?,
            kind: $crate::model::StepKind::parse(&kind),
            state: state
                .parse()
                .map_err(|e: crate::model::UnknownState| JournalError::Store(e.to_string()))?,
            attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
            last_error: row.try_get("last_error")?,
            result: row.try_get("result")?,
            provider_ref: row.try_get("provider_ref")?,
            park_until: row.try_get("park_until")?,
            attention: row.try_get("attention")?,
            created_ms: row.try_get("created_ms")?,
            updated_ms: row.try_get("updated_ms")?,
            sent_ms: row.try_get("sent_ms")?,
        }
    }};
}
pub(crate) use step_from_row;

/// Writes one history row inside the transaction `$tx`.
macro_rules! insert_transition {
    ($tx:expr, $sql:expr, $id:expr, $from:expr, $to:expr, $at:expr, $attempts:expr, $change:expr) => {{
        let change: &Change = $change;
        let from: Option<StepState> = $from;
        let to: StepState = $to;
        sqlx::query(&$sql(
            "INSERT INTO backstop_journal_transitions
                (run_id, step_id, call_id, from_state, to_state, at_ms, attempts, error, actor, reason)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        ))
        .bind(&*$id.run)
        .bind(&*$id.step)
        .bind(&*$id.call)
        .bind(from.map(StepState::as_str))
        .bind(to.as_str())
        .bind($at)
        .bind(i64::from($attempts))
        .bind(change.error.clone())
        .bind(change.actor.as_deref().unwrap_or("journal"))
        .bind(change.reason.clone())
        .execute(&mut *$tx)
        .await?;
    }};
}

impl Journal {
    /// The journal in the SQLite file at `path` (created with its schema when missing). WAL
    /// mode with `synchronous=FULL`: a transition that returned survives the process being
    /// killed and the machine losing power.
    #[cfg(feature = "sqlite")]
    pub async fn sqlite(path: impl AsRef<std::path::Path>) -> Result<Journal, JournalError> {
        use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(10));
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?;
        Journal::from_backend(Backend::Sqlite(pool)).await
    }

    /// A journal in memory, for unit tests only: it is gone with the process.
    #[cfg(feature = "sqlite")]
    pub async fn in_memory() -> Result<Journal, JournalError> {
        // One connection: every connection to `:memory:` is a database of its own.
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await?;
        Journal::from_backend(Backend::Sqlite(pool)).await
    }

    /// The journal in the PostgreSQL database at `url` (its schema created when missing), for
    /// several workers: runs are claimed with `FOR UPDATE SKIP LOCKED`.
    #[cfg(feature = "postgres")]
    pub async fn postgres(url: &str) -> Result<Journal, JournalError> {
        // A database that cannot be reached is an error within seconds, not a hang.
        let options: sqlx::postgres::PgConnectOptions = url.parse()?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options.clone())
            .await?;
        let mut journal = Journal::from_backend(Backend::Postgres(pool)).await?;
        journal.step_conns = Some(crate::step_conns::StepConnections::new(options));
        Ok(journal)
    }

    /// Opens the journal a URL names: `sqlite://PATH` (or a path ending in `.db`/`.sqlite`),
    /// `sqlite::memory:`, or `postgres://...`.
    pub async fn open(url: &str) -> Result<Journal, JournalError> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            #[cfg(feature = "postgres")]
            return Journal::postgres(url).await;
            #[cfg(not(feature = "postgres"))]
            return Err(JournalError::Store(
                "this build has no PostgreSQL support (feature `postgres`)".into(),
            ));
        }
        #[cfg(feature = "sqlite")]
        {
            if url == "sqlite::memory:" {
                return Journal::in_memory().await;
            }
            let path = url.strip_prefix("sqlite://").unwrap_or(url);
            Journal::sqlite(path).await
        }
        #[cfg(not(feature = "sqlite"))]
        Err(JournalError::Store(format!(
            "{url}: this build has no SQLite support (feature `sqlite`)"
        )))
    }

    async fn from_backend(backend: Backend) -> Result<Journal, JournalError> {
        let journal = Journal {
            backend,
            #[cfg(feature = "postgres")]
            step_conns: None,
            clock: system_clock(),
        };
        journal.migrate().await?;
        Ok(journal)
    }

    /// Replaces the clock the journal writes with (a test's, advanced by hand).
    #[must_use]
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// The time now, as the journal writes it.
    pub fn now_ms(&self) -> i64 {
        (self.clock)()
    }

    /// `sqlite` or `postgres`.
    pub fn store_name(&self) -> &'static str {
        match &self.backend {
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(_) => "sqlite",
            #[cfg(feature = "postgres")]
            Backend::Postgres(_) => "postgres",
        }
    }

    async fn migrate(&self) -> Result<(), JournalError> {
        let now = self.now_ms();
        with_pool!(self, |pool, sql| {
            let serial = if self.store_name() == "sqlite" {
                "INTEGER PRIMARY KEY AUTOINCREMENT"
            } else {
                "BIGSERIAL PRIMARY KEY"
            };
            let mut tx = pool.begin().await?;
            if self.store_name() == "postgres" {
                // Two workers starting together apply the schema once.
                sqlx::query("SELECT pg_advisory_xact_lock(7262116950237460)")
                    .execute(&mut *tx)
                    .await?;
            }
            sqlx::query(
                "CREATE TABLE IF NOT EXISTS backstop_journal_schema (
                    version BIGINT PRIMARY KEY, applied_ms BIGINT NOT NULL)",
            )
            .execute(&mut *tx)
            .await?;
            let applied: Option<i64> =
                sqlx::query_scalar("SELECT MAX(version) FROM backstop_journal_schema")
                    .fetch_one(&mut *tx)
                    .await?;
            for (version, ddl) in migrations(serial) {
                if applied.is_some_and(|a| a >= version) {
                    continue;
                }
                for statement in ddl.split(';').map(str::trim).filter(|s| !s.is_empty()) {
                    sqlx::query(statement).execute(&mut *tx).await?;
                }
                sqlx::query(&sql(
                    "INSERT INTO backstop_journal_schema (version, applied_ms) VALUES ($1, $2)",
                ))
                .bind(version)
                .bind(now)
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
            Ok(())
        })
    }

    /// Records `new` as `pending`, or returns the step already recorded under its ids (a
    /// resumed run). A step recorded with other arguments is refused.
    pub async fn begin(&self, new: &NewStep) -> Result<Step, JournalError> {
        let now = self.now_ms();
        let id = &new.id;
        let inserted = with_pool!(self, |pool, sql| {
            let mut tx = pool.begin().await?;
            let inserted = sqlx::query(&sql(&format!(
                "INSERT INTO backstop_journal_steps ({STEP_COLUMNS})
                 VALUES ($1, $2, $3, $4, $5, $6, $7, 'pending', 0, NULL, NULL, NULL, NULL, NULL,
                         $8, $8, NULL)
                 ON CONFLICT (run_id, step_id, call_id) DO NOTHING"
            )))
            .bind(&*id.run)
            .bind(&*id.step)
            .bind(&*id.call)
            .bind(&new.tool)
            .bind(&new.key)
            .bind(&new.args_digest)
            .bind(new.kind.as_str())
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected()
                == 1;
            if inserted {
                insert_transition!(
                    tx,
                    sql,
                    id,
                    None,
                    StepState::Pending,
                    now,
                    0u32,
                    &Change::default()
                );
                sqlx::query(&sql(
                    "INSERT INTO backstop_journal_runs (run_id, created_ms, updated_ms)
                     VALUES ($1, $2, $2)
                     ON CONFLICT (run_id) DO UPDATE SET updated_ms = $2",
                ))
                .bind(&*id.run)
                .bind(now)
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
            inserted
        });
        let step = self
            .step(id)
            .await?
            .ok_or_else(|| JournalError::NotFound(format!("step {id}")))?;
        if !inserted && (step.args_digest != new.args_digest || step.tool != new.tool) {
            return Err(JournalError::ArgsChanged {
                id: id.clone(),
                recorded: Box::new(CallIdentity {
                    tool: step.tool,
                    args_digest: step.args_digest,
                }),
                refused: Box::new(CallIdentity {
                    tool: new.tool.clone(),
                    args_digest: new.args_digest.clone(),
                }),
            });
        }
        Ok(step)
    }

    /// Moves step `id` from one of `from` to `to`, writing `change` and a history row in one
    /// transaction. Refused (nothing written) when the step is elsewhere, or when the journal
    /// does not allow the move ([`StepState::can_move_to`]); only an operator's repair
    /// ([`resolve`](Self::resolve)) goes further.
    pub async fn transition(
        &self,
        id: &StepId,
        from: &[StepState],
        to: StepState,
        change: Change,
    ) -> Result<Step, JournalError> {
        self.move_step(id, from, to, change, false).await
    }

    /// [`transition`](Self::transition), and with `repair` any move (an operator's repair, or
    /// the journal handing a step to a person, which keeps its state).
    pub(crate) async fn move_step(
        &self,
        id: &StepId,
        from: &[StepState],
        to: StepState,
        change: Change,
        repair: bool,
    ) -> Result<Step, JournalError> {
        let now = self.now_ms();
        let conflict = |found: Option<StepState>| JournalError::Conflict {
            id: id.clone(),
            expected: from.to_vec(),
            found,
            to,
        };
        let current = self.step(id).await?.ok_or_else(|| conflict(None))?;
        if !from.contains(&current.state) || (!repair && !current.state.can_move_to(to)) {
            return Err(conflict(Some(current.state)));
        }
        let moved = with_pool!(self, |pool, sql| {
            let mut tx = pool.begin().await?;
            let attempts = i64::from(current.attempts) + i64::from(change.attempt);
            let done = sqlx::query(&sql(
                "UPDATE backstop_journal_steps SET state = $1, attempts = $2,
                    last_error = COALESCE($3, last_error), result = COALESCE($4, result),
                    provider_ref = COALESCE($5, provider_ref), park_until = $6, attention = $7,
                    updated_ms = $8, sent_ms = CASE WHEN $1 = 'sent' THEN $8 ELSE sent_ms END
                 WHERE run_id = $9 AND step_id = $10 AND call_id = $11 AND state = $12",
            ))
            .bind(to.as_str())
            .bind(attempts)
            .bind(&change.error)
            .bind(&change.result)
            .bind(&change.provider_ref)
            .bind(change.park_until)
            .bind(&change.attention)
            .bind(now)
            .bind(&*id.run)
            .bind(&*id.step)
            .bind(&*id.call)
            .bind(current.state.as_str())
            .execute(&mut *tx)
            .await?
            .rows_affected()
                == 1;
            if done {
                let from = Some(current.state);
                let attempts = u32::try_from(attempts).unwrap_or(u32::MAX);
                insert_transition!(tx, sql, id, from, to, now, attempts, &change);
                sqlx::query(&sql(
                    "UPDATE backstop_journal_runs SET updated_ms = $1 WHERE run_id = $2",
                ))
                .bind(now)
                .bind(&*id.run)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
            }
            done
        });
        let step = self.step(id).await?.ok_or_else(|| conflict(None))?;
        if !moved {
            // Another worker moved it between the read and the write.
            return Err(conflict(Some(step.state)));
        }
        crate::obs::transition(&step, current.state, now - current.updated_ms);
        Ok(step)
    }

    /// The step recorded under `id`.
    pub async fn step(&self, id: &StepId) -> Result<Option<Step>, JournalError> {
        with_pool!(self, |pool, sql| {
            let row = sqlx::query(&sql(&format!(
                "SELECT {STEP_COLUMNS} FROM backstop_journal_steps
                 WHERE run_id = $1 AND step_id = $2 AND call_id = $3"
            )))
            .bind(&*id.run)
            .bind(&*id.step)
            .bind(&*id.call)
            .fetch_optional(pool)
            .await?;
            match row {
                Some(row) => Ok(Some(step_from_row!(row))),
                None => Ok(None),
            }
        })
    }

    /// Every step of `run`, in the order they were recorded.
    pub async fn run(&self, run: &str) -> Result<Vec<Step>, JournalError> {
        with_pool!(self, |pool, sql| {
            let rows = sqlx::query(&sql(&format!(
                "SELECT {STEP_COLUMNS} FROM backstop_journal_steps WHERE run_id = $1
                 ORDER BY created_ms, step_id, call_id"
            )))
            .bind(run)
            .fetch_all(pool)
            .await?;
            let mut steps = Vec::with_capacity(rows.len());
            for row in rows {
                steps.push(step_from_row!(row));
            }
            Ok(steps)
        })
    }

    /// Steps waiting for a person, and parked steps (with when they wake).
    pub async fn stuck(&self) -> Result<Vec<Step>, JournalError> {
        with_pool!(self, |pool, sql| {
            let rows = sqlx::query(&sql(&format!(
                "SELECT {STEP_COLUMNS} FROM backstop_journal_steps
                 WHERE attention IS NOT NULL OR state = 'parked'
                 ORDER BY updated_ms, run_id, step_id"
            )))
            .fetch_all(pool)
            .await?;
            let mut steps = Vec::with_capacity(rows.len());
            for row in rows {
                steps.push(step_from_row!(row));
            }
            Ok(steps)
        })
    }

    /// Every recorded transition of step `id`, oldest first.
    pub async fn history(&self, id: &StepId) -> Result<Vec<StepTransition>, JournalError> {
        self.transitions(&id.run, Some(id)).await
    }

    /// Every recorded transition of every step of `run`, oldest first, in one query.
    pub async fn run_history(&self, run: &str) -> Result<Vec<StepTransition>, JournalError> {
        self.transitions(run, None).await
    }

    async fn transitions(
        &self,
        run: &str,
        step: Option<&StepId>,
    ) -> Result<Vec<StepTransition>, JournalError> {
        type Row = (
            String,
            String,
            Option<String>,
            String,
            i64,
            i64,
            Option<String>,
            String,
            Option<String>,
        );
        let one = if step.is_some() {
            "AND step_id = $2 AND call_id = $3"
        } else {
            ""
        };
        let query = format!(
            "SELECT step_id, call_id, from_state, to_state, at_ms, attempts, error, actor, reason
             FROM backstop_journal_transitions WHERE run_id = $1 {one} ORDER BY id"
        );
        let rows: Vec<Row> = with_pool!(self, |pool, sql| {
            let statement = sql(&query);
            let mut q = sqlx::query_as(&statement).bind(run);
            if let Some(id) = step {
                q = q.bind(&*id.step).bind(&*id.call);
            }
            q.fetch_all(pool).await?
        });
        let parse = |s: &str| {
            s.parse::<StepState>()
                .map_err(|e| JournalError::Store(e.to_string()))
        };
        rows.into_iter()
            .map(
                |(step_id, call_id, from, to, at_ms, attempts, error, actor, reason)| {
                    Ok(StepTransition {
                        id: match step {
                            Some(id) => id.clone(),
                            None => StepId::new(run, &step_id, &call_id),
                        },
                        from: from.as_deref().map(parse).transpose()?,
                        to: parse(&to)?,
                        at_ms,
                        attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
                        error,
                        actor,
                        reason,
                    })
                },
            )
            .collect()
    }

    /// Claims `run` for `worker` for `lease`: `true` when no other worker holds it (a claim
    /// whose lease ran out is free). Two workers never both hold a run.
    pub async fn claim(
        &self,
        run: &str,
        worker: &str,
        lease: Duration,
    ) -> Result<bool, JournalError> {
        let now = self.now_ms();
        let until = now.saturating_add(i64::try_from(lease.as_millis()).unwrap_or(i64::MAX));
        with_pool!(self, |pool, sql| {
            let claimed = sqlx::query(&sql(
                "UPDATE backstop_journal_runs SET claimed_by = $1, claim_until = $2
                 WHERE run_id = $3 AND (claimed_by IS NULL OR claimed_by = $1 OR claim_until < $4)",
            ))
            .bind(worker)
            .bind(until)
            .bind(run)
            .bind(now)
            .execute(pool)
            .await?
            .rows_affected();
            Ok(claimed == 1)
        })
    }

    /// Gives `run` back (only `worker`'s own claim).
    pub async fn release(&self, run: &str, worker: &str) -> Result<(), JournalError> {
        with_pool!(self, |pool, sql| {
            sqlx::query(&sql(
                "UPDATE backstop_journal_runs SET claimed_by = NULL, claim_until = NULL
                 WHERE run_id = $1 AND claimed_by = $2",
            ))
            .bind(run)
            .bind(worker)
            .execute(pool)
            .await?;
            Ok(())
        })
    }

    /// An operator's repair of a step that is not over, recorded with `who` and `why`.
    pub async fn resolve(
        &self,
        id: &StepId,
        resolution: Resolution,
        who: &str,
        why: &str,
    ) -> Result<Step, JournalError> {
        let step = self
            .step(id)
            .await?
            .ok_or_else(|| JournalError::NotFound(format!("step {id}")))?;
        if step.state.is_final() {
            return Err(JournalError::Conflict {
                id: id.clone(),
                expected: StepState::ALL
                    .into_iter()
                    .filter(|s| !s.is_final())
                    .collect(),
                found: Some(step.state),
                to: match resolution {
                    Resolution::Succeeded { .. } => StepState::ReconciledSucceeded,
                    Resolution::Failed => StepState::ReconciledFailed,
                    Resolution::Retry => StepState::Pending,
                },
            });
        }
        let (to, result) = match resolution {
            Resolution::Succeeded { result } => (StepState::ReconciledSucceeded, result),
            Resolution::Failed => (StepState::ReconciledFailed, None),
            Resolution::Retry => (StepState::Pending, None),
        };
        let change = Change {
            result,
            actor: Some(who.to_owned()),
            reason: Some(why.to_owned()),
            ..Change::default()
        };
        let step = self.move_step(id, &[step.state], to, change, true).await?;
        self.reopen_run(&id.run, who, &format!("step {id} resolved: {why}"))
            .await?;
        Ok(step)
    }
}
