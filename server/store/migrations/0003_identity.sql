-- Measured boot and names bound to identity (docs/attestation.md "Measured boot", docs/join.md).

-- The AK the server credential-activated at the agent's last attestation (TPMT_PUBLIC, hex):
-- the only key whose quotes the server believes for that agent.
ALTER TABLE agents ADD COLUMN ak_public TEXT NOT NULL DEFAULT '';

-- Join nonces the server chose for TPM2_Quote: each used once, before it expires.
CREATE TABLE join_nonces (
    agent_id      TEXT   NOT NULL,
    nonce_sha256  TEXT   NOT NULL,
    pool          TEXT   NOT NULL,
    expires_at    BIGINT NOT NULL,
    PRIMARY KEY (agent_id, nonce_sha256)
);

CREATE INDEX join_nonces_expires_at ON join_nonces (expires_at);

-- A node name belongs to the EK that was first granted a token for it, until an operator releases it.
CREATE TABLE node_names (
    node_name  TEXT   NOT NULL PRIMARY KEY,
    agent_id   TEXT   NOT NULL,
    ek_hash    TEXT   NOT NULL,
    bound_at   BIGINT NOT NULL
);

CREATE INDEX node_names_agent ON node_names (agent_id);

-- The optional enrolment registry: the machines a rack delivery lists, by EK hash.
CREATE TABLE enrolments (
    ek_hash      TEXT   NOT NULL PRIMARY KEY,
    node_name    TEXT   NOT NULL,
    pool         TEXT   NOT NULL,
    serial       TEXT   NOT NULL DEFAULT '',
    disk_hints   TEXT   NOT NULL DEFAULT '{}',
    enrolled_at  BIGINT NOT NULL
);

CREATE UNIQUE INDEX enrolments_node_name ON enrolments (node_name);
