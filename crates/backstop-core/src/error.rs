use crate::{Dependency, Outcome};
use std::{error::Error, fmt, time::Duration};

/// The boxed error type tower middleware passes around.
pub type BoxError = Box<dyn Error + Send + Sync>;

/// Formats a [`Duration`] for people and models: `350 ms`, `2 s`, `1.5 s`, `27 s`, `20 min`.
#[derive(Clone, Copy, Debug)]
pub struct HumanDuration(pub Duration);

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        let ms = d.as_millis();
        if ms < 1_000 {
            if d > Duration::ZERO && ms == 0 {
                return write!(f, "{} us", d.as_micros());
            }
            write!(f, "{ms} ms")
        } else if ms < 60_000 {
            if ms % 1_000 == 0 {
                write!(f, "{} s", ms / 1_000)
            } else {
                write!(f, "{:.1} s", d.as_secs_f64())
            }
        } else if ms % 60_000 == 0 {
            write!(f, "{} min", ms / 60_000)
        } else {
            write!(f, "{} s", d.as_secs())
        }
    }
}

struct Named<'a>(Option<&'a Dependency>);

impl fmt::Display for Named<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(d) => write!(f, "{d}"),
            None => f.write_str("the dependency"),
        }
    }
}

/// One attempt took longer than the per-attempt timeout.
///
/// The request was sent and no reply came in time, so its side effect is
/// [`Outcome::Unknown`]. Produced by `backstop-timeout`'s attempt timeout.
#[derive(Clone, Debug)]
pub struct AttemptTimedOut {
    dependency: Option<Dependency>,
    limit: Duration,
}

impl AttemptTimedOut {
    /// An attempt to `dependency` that did not answer within `limit`.
    pub fn new(dependency: Option<Dependency>, limit: Duration) -> Self {
        AttemptTimedOut { dependency, limit }
    }

    /// The dependency, when known.
    pub fn dependency(&self) -> Option<&Dependency> {
        self.dependency.as_ref()
    }

    /// The limit that was exceeded.
    pub fn limit(&self) -> Duration {
        self.limit
    }

    /// Always [`Outcome::Unknown`]: the request was sent, the reply was not seen.
    pub fn outcome(&self) -> Outcome {
        Outcome::Unknown
    }
}

impl fmt::Display for AttemptTimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} did not reply within the {} attempt timeout",
            Named(self.dependency.as_ref()),
            HumanDuration(self.limit)
        )
    }
}

impl Error for AttemptTimedOut {}

/// The overall deadline of a call passed.
///
/// When the deadline passed before the request was sent, the outcome is
/// [`Outcome::NotSent`]; when it passed while an attempt was in flight, it is
/// [`Outcome::Unknown`].
#[derive(Clone, Debug)]
pub struct DeadlineExceeded {
    dependency: Option<Dependency>,
    outcome: Outcome,
}

impl DeadlineExceeded {
    /// A deadline that passed with the given knowledge of the side effect.
    pub fn new(dependency: Option<Dependency>, outcome: Outcome) -> Self {
        DeadlineExceeded {
            dependency,
            outcome,
        }
    }

    /// The dependency, when known.
    pub fn dependency(&self) -> Option<&Dependency> {
        self.dependency.as_ref()
    }

    /// What is known about the side effect.
    pub fn outcome(&self) -> Outcome {
        self.outcome
    }
}

impl fmt::Display for DeadlineExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.outcome {
            Outcome::NotSent => write!(
                f,
                "the deadline for the call to {} had already passed, so it was not sent",
                Named(self.dependency.as_ref())
            ),
            _ => write!(
                f,
                "the deadline for the call to {} passed while waiting for its reply",
                Named(self.dependency.as_ref())
            ),
        }
    }
}

impl Error for DeadlineExceeded {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_durations() {
        let cases = [
            (Duration::from_millis(350), "350 ms"),
            (Duration::from_secs(2), "2 s"),
            (Duration::from_millis(1500), "1.5 s"),
            (Duration::from_secs(27), "27 s"),
            (Duration::from_secs(1200), "20 min"),
            (Duration::from_secs(61), "61 s"),
            (Duration::from_micros(5), "5 us"),
            (Duration::ZERO, "0 ms"),
        ];
        for (d, want) in cases {
            assert_eq!(HumanDuration(d).to_string(), want);
        }
    }

    #[test]
    fn messages_name_the_dependency() {
        let e = AttemptTimedOut::new(Some("carrier-api".into()), Duration::from_secs(3));
        assert_eq!(
            e.to_string(),
            "carrier-api did not reply within the 3 s attempt timeout"
        );
        let e = DeadlineExceeded::new(None, Outcome::NotSent);
        assert!(e.to_string().contains("the dependency"), "{e}");
    }
}
