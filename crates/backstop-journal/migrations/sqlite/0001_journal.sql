-- The step journal's schema: steps, their transitions, runs and their events.

CREATE TABLE backstop_journal_steps (
    run_id TEXT NOT NULL, step_id TEXT NOT NULL, call_id TEXT NOT NULL,
    tool TEXT NOT NULL, idem_key TEXT NOT NULL, args_digest TEXT NOT NULL,
    kind TEXT NOT NULL, state TEXT NOT NULL, attempts BIGINT NOT NULL,
    last_error TEXT, result TEXT, provider_ref TEXT, park_until BIGINT,
    attention TEXT, created_ms BIGINT NOT NULL, updated_ms BIGINT NOT NULL,
    sent_ms BIGINT,
    PRIMARY KEY (run_id, step_id, call_id)
);
CREATE INDEX backstop_journal_steps_state ON backstop_journal_steps (state);

CREATE TABLE backstop_journal_transitions (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, step_id TEXT NOT NULL, call_id TEXT NOT NULL,
    from_state TEXT, to_state TEXT NOT NULL, at_ms BIGINT NOT NULL,
    attempts BIGINT NOT NULL, error TEXT, actor TEXT NOT NULL, reason TEXT
);
CREATE INDEX backstop_journal_transitions_step
    ON backstop_journal_transitions (run_id, step_id, call_id, id);

CREATE TABLE backstop_journal_runs (
    run_id TEXT PRIMARY KEY, created_ms BIGINT NOT NULL, updated_ms BIGINT NOT NULL,
    claimed_by TEXT, claim_until BIGINT,
    workflow TEXT, input TEXT, state TEXT NOT NULL DEFAULT 'pending',
    output TEXT, error TEXT, wake_ms BIGINT,
    forked_from TEXT, forked_at_step TEXT
);
CREATE INDEX backstop_journal_runs_state ON backstop_journal_runs (state, claim_until);
CREATE INDEX backstop_journal_runs_forked_from ON backstop_journal_runs (forked_from);

CREATE TABLE backstop_journal_run_events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, at_ms BIGINT NOT NULL, actor TEXT NOT NULL,
    action TEXT NOT NULL, reason TEXT
);
CREATE INDEX backstop_journal_run_events_run ON backstop_journal_run_events (run_id, id);
