-- Join history (an audit trail: kept when the agent is deleted, so no foreign key).
-- PostgreSQL: an identity column numbers rows.

CREATE TABLE joins (
    id         BIGINT  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    agent_id   TEXT    NOT NULL,
    node_name  TEXT    NOT NULL,
    pool       TEXT    NOT NULL,
    token_id   TEXT    NOT NULL,
    verdict    TEXT    NOT NULL,
    at         BIGINT  NOT NULL,
    details    TEXT    NOT NULL DEFAULT '{}'
);

CREATE INDEX joins_agent ON joins (agent_id, at);
