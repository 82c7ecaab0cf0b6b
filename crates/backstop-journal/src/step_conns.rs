//! PostgreSQL connections of the journal's own for the two writes every step makes. sqlx's pool
//! checks each connection it takes back with a round trip of its own (a `Sync`, in a task after
//! the statement's answer); a step's writes would cost twice their round trips. These are
//! handed back as they are after a statement that succeeded, and closed after one that failed.

use crate::journal::JournalError;
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

    /// An idle connection, or a new one (within 5 s, as the pool's).
    pub(crate) async fn checkout(self: &Arc<Self>) -> Result<Checkout, JournalError> {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| JournalError::Store("the journal is closed".into()))?;
        let idle = self.idle.lock().expect("step connections").pop();
        let conn = match idle {
            Some(conn) => conn,
            None => tokio::time::timeout(
                Duration::from_secs(5),
                PgConnection::connect_with(&self.options),
            )
            .await
            .map_err(|_| JournalError::Store("connecting to PostgreSQL timed out".into()))??,
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
