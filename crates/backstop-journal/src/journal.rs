//! The journal: one SQL schema on SQLite (embedded) or PostgreSQL (shared), its pool, clock and
//! migrations. The steps' transitions are in `steps.rs`, the runs' in `run.rs`.

use crate::JournalError;
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
/// once per backend). The statements are written once, with `$N` parameters, which both
/// PostgreSQL and sqlx's SQLite driver bind by number.
macro_rules! with_pool {
    ($self:expr, |$pool:ident| $body:expr) => {
        match &$self.backend {
            #[cfg(feature = "sqlite")]
            $crate::journal::Backend::Sqlite($pool) => $body,
            #[cfg(feature = "postgres")]
            $crate::journal::Backend::Postgres($pool) => $body,
        }
    };
}
pub(crate) use with_pool;

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
            return Err(JournalError::store(
                "this build has no PostgreSQL support (feature `postgres`)",
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
        Err(JournalError::store(format!(
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

    /// Applies the schema's migrations (`migrations/sqlite`, `migrations/postgres`, embedded at
    /// build time); on PostgreSQL under sqlx's advisory lock, so workers starting together
    /// apply them once.
    async fn migrate(&self) -> Result<(), JournalError> {
        match &self.backend {
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(pool) => sqlx::migrate!("migrations/sqlite").run(pool).await?,
            #[cfg(feature = "postgres")]
            Backend::Postgres(pool) => sqlx::migrate!("migrations/postgres").run(pool).await?,
        }
        Ok(())
    }
}
