//! The facade's integration tests in one binary, a module per concern.

mod adaptive_timeout;
mod attempt_ends;
mod body_timer;
mod breaker;
mod budget;
mod dead_letters_redis;
mod hedging;
mod idempotency;
mod throttle;
