use crate::{Error, ErrorKind};
use backstop_core::{Dependency, Outcome};
use backstop_idempotency::IdempotencyKey;
use std::{
    collections::VecDeque,
    fmt,
    sync::{Arc, Mutex},
    time::SystemTime,
};

/// A call that finally failed after it may have changed something (a mutating request), handed
/// to a [`DeadLetterSink`] so that a person or a reconciliation job can settle it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// When it failed (wall clock).
    pub at: SystemTime,
    /// The dependency.
    pub dependency: Option<Dependency>,
    /// The agent run, when the request carried an `ActionContext`.
    pub run_id: Option<Arc<str>>,
    /// The tool call, when known.
    pub tool_call_id: Option<Arc<str>>,
    /// The idempotency key the call carried: use it to ask the dependency what happened, or to
    /// repeat the call safely.
    pub idempotency_key: Option<IdempotencyKey>,
    /// What is known of the side effect.
    pub outcome: Outcome,
    /// The kind of failure.
    pub kind: ErrorKind,
    /// Attempts made.
    pub attempts: u32,
    /// The error, as the model saw it.
    pub cause: String,
}

impl DeadLetter {
    pub(crate) fn new(
        error: &Error,
        run_id: Option<Arc<str>>,
        tool_call_id: Option<Arc<str>>,
        idempotency_key: Option<IdempotencyKey>,
    ) -> Self {
        DeadLetter {
            at: SystemTime::now(),
            dependency: error.dependency().cloned(),
            run_id,
            tool_call_id,
            idempotency_key,
            outcome: error.outcome(),
            kind: error.kind(),
            attempts: error.attempts(),
            cause: error.to_string(),
        }
    }

    /// The letter as one JSON object (feature `json`).
    #[cfg(feature = "json")]
    pub fn to_json(&self) -> serde_json::Value {
        let ms = self
            .at
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        serde_json::json!({
            "at_unix_ms": ms,
            "dependency": self.dependency.as_ref().map(|d| d.as_str()),
            "run_id": self.run_id.as_deref(),
            "tool_call_id": self.tool_call_id.as_deref(),
            "idempotency_key": self.idempotency_key.as_ref().map(|k| k.as_str()),
            "outcome": self.outcome.as_str(),
            "kind": self.kind.as_str(),
            "attempts": self.attempts,
            "cause": self.cause,
        })
    }
}

/// Where dead letters go.
pub trait DeadLetterSink: Send + Sync + fmt::Debug {
    /// Takes one letter. Called on the failing call's task: keep it short (queue, don't send).
    fn record(&self, letter: DeadLetter);
}

/// Keeps the last `capacity` letters in memory (for tests, demos and small runtimes).
#[derive(Debug)]
pub struct MemorySink {
    letters: Mutex<VecDeque<DeadLetter>>,
    capacity: usize,
}

impl MemorySink {
    /// A sink that keeps at most `capacity` letters, dropping the oldest.
    pub fn new(capacity: usize) -> Self {
        MemorySink {
            letters: Mutex::new(VecDeque::new()),
            capacity: capacity.max(1),
        }
    }

    /// The letters held, oldest first.
    pub fn letters(&self) -> Vec<DeadLetter> {
        self.lock().iter().cloned().collect()
    }

    /// Takes every letter out.
    pub fn take(&self) -> Vec<DeadLetter> {
        self.lock().drain(..).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<DeadLetter>> {
        self.letters.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Default for MemorySink {
    fn default() -> Self {
        MemorySink::new(10_000)
    }
}

impl DeadLetterSink for MemorySink {
    fn record(&self, letter: DeadLetter) {
        let mut l = self.lock();
        if l.len() == self.capacity {
            l.pop_front();
        }
        l.push_back(letter);
    }
}

#[cfg(feature = "json")]
pub use json_lines::JsonLinesSink;

#[cfg(feature = "json")]
mod json_lines {
    use super::{DeadLetter, DeadLetterSink};
    use std::{
        fs::{File, OpenOptions},
        io::{self, Write},
        path::Path,
        sync::Mutex,
    };

    /// Appends each letter as one JSON object per line to a file, flushed per letter (feature
    /// `json`).
    ///
    /// The write happens on the failing call's task; it is one small append, on the failure path
    /// only. A write error is reported through `tracing` and the letter is lost, never the call.
    #[derive(Debug)]
    pub struct JsonLinesSink {
        file: Mutex<File>,
    }

    impl JsonLinesSink {
        /// Opens (creating or appending to) the file at `path`.
        pub fn open(path: impl AsRef<Path>) -> io::Result<Self> {
            let file = OpenOptions::new().create(true).append(true).open(path)?;
            Ok(JsonLinesSink {
                file: Mutex::new(file),
            })
        }
    }

    impl DeadLetterSink for JsonLinesSink {
        fn record(&self, letter: DeadLetter) {
            let mut line = letter.to_json().to_string();
            line.push('\n');
            let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = f.write_all(line.as_bytes()).and_then(|()| f.flush()) {
                tracing::error!(target: "backstop::dead_letter", error = %e, "could not write a dead letter");
            }
        }
    }
}
