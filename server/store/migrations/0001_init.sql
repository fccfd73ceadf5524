-- Agents, bootstrap tokens and join request ids. Common to SQLite and PostgreSQL.
-- Times are Unix seconds. Booleans are BOOLEAN (0/1 in SQLite).

CREATE TABLE agents (
    spiffe_id          TEXT    NOT NULL PRIMARY KEY,
    attestation_type   TEXT    NOT NULL,
    ek_hash            TEXT    NOT NULL,
    first_attested_at  BIGINT  NOT NULL,
    last_attested_at   BIGINT  NOT NULL,
    svid_serial        TEXT    NOT NULL,
    svid_expires_at    BIGINT  NOT NULL,
    selectors          TEXT    NOT NULL DEFAULT '[]',
    can_reattest       BOOLEAN NOT NULL DEFAULT TRUE,
    banned             BOOLEAN NOT NULL DEFAULT FALSE,
    placeholder        BOOLEAN NOT NULL DEFAULT FALSE
);

CREATE INDEX agents_ek_hash ON agents (ek_hash);

-- A token row never outlives its agent; the secret itself is never stored.
CREATE TABLE tokens (
    agent_id       TEXT    NOT NULL REFERENCES agents (spiffe_id) ON DELETE CASCADE,
    token_id       TEXT    NOT NULL,
    secret_sha256  TEXT    NOT NULL,
    pool           TEXT    NOT NULL,
    node_name      TEXT    NOT NULL,
    issued_at      BIGINT  NOT NULL,
    expires_at     BIGINT  NOT NULL,
    backend_ref    TEXT    NOT NULL DEFAULT '',
    revoked        BOOLEAN NOT NULL DEFAULT FALSE,
    PRIMARY KEY (token_id),
    CHECK (length(secret_sha256) = 64)
);

-- The invariant: at most one live (unrevoked) token per agent, kept by the database.
CREATE UNIQUE INDEX tokens_one_live ON tokens (agent_id) WHERE NOT revoked;

CREATE INDEX tokens_agent ON tokens (agent_id);

CREATE INDEX tokens_expires_at ON tokens (expires_at);

-- Join request ids already seen, to refuse replays until they are pruned.
CREATE TABLE join_requests (
    agent_id    TEXT   NOT NULL,
    request_id  TEXT   NOT NULL,
    expires_at  BIGINT NOT NULL,
    PRIMARY KEY (agent_id, request_id)
);

CREATE INDEX join_requests_expires_at ON join_requests (expires_at);
