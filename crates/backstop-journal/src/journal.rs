//! The journal: its store (SQLite, embedded, or PostgreSQL, shared; `store/`) and its clock.
//! The steps' transitions are in `steps.rs`, the runs' in `run.rs`.

use crate::{
    JournalError,
    store::{self, Store},
};
use chrono::{DateTime, Utc};
use std::{fmt, sync::Arc};

/// What identifies a call a step makes: its tool and its arguments' digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallIdentity {
    /// The tool (or dependency) called.
    pub tool: String,
    /// The digest of its arguments, as [`Step::args_digest`](crate::Step::args_digest) holds it.
    pub args_digest: String,
}

/// The time the journal writes (replaceable for tests). The journal keeps times to the
/// millisecond.
pub type Clock = Arc<dyn Fn() -> DateTime<Utc> + Send + Sync>;

fn system_clock() -> Clock {
    Arc::new(Utc::now)
}

/// A time as the store keeps it: milliseconds since the Unix epoch.
pub(crate) fn millis(at: DateTime<Utc>) -> i64 {
    at.timestamp_millis()
}

/// `after` past `at`, or the latest time chrono has.
pub(crate) fn later(at: DateTime<Utc>, after: std::time::Duration) -> DateTime<Utc> {
    chrono::TimeDelta::from_std(after)
        .ok()
        .and_then(|d| at.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// A time the store kept (milliseconds since the Unix epoch); out of chrono's range (no
/// clock writes one) it is the latest time chrono has.
pub(crate) fn at_millis(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(ms).unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// The durable step journal, on SQLite or PostgreSQL. Cheap to clone (a pool).
#[derive(Clone)]
pub struct Journal {
    pub(crate) store: Arc<dyn Store>,
    clock: Clock,
}

impl fmt::Debug for Journal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Journal")
            .field("store", &self.store_name())
            .finish_non_exhaustive()
    }
}

impl Journal {
    /// The journal in the SQLite file at `path` (created with its schema when missing). WAL
    /// mode with `synchronous=FULL`: a transition that returned survives the process being
    /// killed and the machine losing power.
    #[cfg(feature = "sqlite")]
    pub async fn sqlite(path: impl AsRef<std::path::Path>) -> Result<Journal, JournalError> {
        Journal::on(store::Sqlite::open(path.as_ref()).await?).await
    }

    /// A journal in memory, for unit tests only: it is gone with the process.
    #[cfg(feature = "sqlite")]
    pub async fn in_memory() -> Result<Journal, JournalError> {
        Journal::on(store::Sqlite::in_memory().await?).await
    }

    /// The journal in the PostgreSQL database at `url` (its schema created when missing), for
    /// several workers: runs are claimed with `FOR UPDATE SKIP LOCKED`.
    #[cfg(feature = "postgres")]
    pub async fn postgres(url: &str) -> Result<Journal, JournalError> {
        Journal::on(store::Postgres::connect(url).await?).await
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

    /// The journal on `store`, its schema migrated.
    async fn on(store: impl Store + 'static) -> Result<Journal, JournalError> {
        store.migrate().await?;
        Ok(Journal {
            store: Arc::new(store),
            clock: system_clock(),
        })
    }

    /// Replaces the clock the journal writes with (a test's, advanced by hand).
    #[must_use]
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// The time now, as the journal writes it.
    pub fn now(&self) -> DateTime<Utc> {
        at_millis(self.now_ms())
    }

    /// The time now, as the store keeps it.
    pub(crate) fn now_ms(&self) -> i64 {
        millis((self.clock)())
    }

    /// `sqlite` or `postgres`.
    pub(crate) fn store_name(&self) -> &'static str {
        self.store.name()
    }
}
