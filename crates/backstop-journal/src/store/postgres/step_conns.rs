//! PostgreSQL connections of the journal's own for the two writes every step makes. sqlx's pool
//! checks each connection it takes back with a round trip of its own (a `Sync`, in a task after
//! the statement's answer); a step's writes would cost twice their round trips. These are
//! handed back as they are after a statement that succeeded, and closed after one that failed.

use crate::JournalError;
use sqlx::{Connection, PgConnection, postgres::PgConnectOptions};
use std::{
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// At most this many, opened as needed.
const MAX: usize = 8;

pub(crate) struct StepConnections {
    options: PgConnectOptions,
    idle: Mutex<Vec<PgConnection>>,
    permits: Arc<Semaphore>,
}

impl StepConnections {
    pub(crate) fn new(options: PgConnectOptions) -> Arc<Self> {
        Arc::new(StepConnections {
            options,
            idle: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(MAX)),
        })
    }

    /// An idle connection, or a new one: waiting for one and connecting each within 5 s, as
    /// the pool's acquire does (a database that cannot be reached is an error, not a hang).
    pub(crate) async fn checkout(self: &Arc<Self>) -> Result<Checkout, JournalError> {
        let permit =
            tokio::time::timeout(Duration::from_secs(5), self.permits.clone().acquire_owned())
                .await
                .map_err(|_| {
                    JournalError::store(format!(
                        "all {MAX} of the journal's step connections stayed busy for 5 s"
                    ))
                })?
                .map_err(|_| JournalError::store("the journal is closed"))?;
        let idle = self.idle.lock().expect("step connections").pop();
        let conn = match idle {
            Some(conn) => conn,
            None => tokio::time::timeout(
                Duration::from_secs(5),
                PgConnection::connect_with(&self.options),
            )
            .await
            .map_err(|_| JournalError::store("connecting to PostgreSQL timed out"))??,
        };
        Ok(Checkout {
            conn: Some(conn),
            home: self.clone(),
            _permit: permit,
        })
    }
}

/// A connection taken out: [`keep`](Self::keep) hands it back; dropped, it is closed.
pub(crate) struct Checkout {
    conn: Option<PgConnection>,
    home: Arc<StepConnections>,
    _permit: OwnedSemaphorePermit,
}

impl Checkout {
    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        self.conn.as_mut().expect("checked out")
    }

    /// Hands the connection back after a statement that succeeded.
    pub(crate) fn keep(mut self) {
        if let Some(conn) = self.conn.take() {
            self.home.idle.lock().expect("step connections").push(conn);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every step connection busy: the next step waits 5 s, then fails with words, and gets
    /// one as soon as one is handed back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_step_waits_for_a_busy_connection_within_bounds() {
        let pg = backstop_testkit::PostgresServer::start().await;
        let conns = StepConnections::new(pg.url().parse().unwrap());
        let mut held = Vec::new();
        for _ in 0..MAX {
            held.push(conns.checkout().await.unwrap());
        }
        let started = tokio::time::Instant::now();
        // Bounded here too, so that a checkout that waits for ever fails the test, not hangs it.
        let waited = tokio::time::timeout(Duration::from_secs(10), conns.checkout()).await;
        let Ok(Err(e)) = waited else {
            panic!("a ninth connection while eight are held");
        };
        assert!(started.elapsed() >= Duration::from_secs(5));
        let cause = std::error::Error::source(&e).map(ToString::to_string);
        assert!(
            cause.is_some_and(|c| c.contains("stayed busy for 5 s")),
            "{e:?}"
        );
        held.pop().unwrap().keep();
        assert!(
            conns.checkout().await.is_ok(),
            "one handed back is taken again"
        );
    }
}
