-- Join history (an audit trail: kept when the agent is deleted, so no foreign key).
-- SQLite: INTEGER PRIMARY KEY is the rowid and numbers rows by itself.

CREATE TABLE joins (
    id         INTEGER NOT NULL PRIMARY KEY,
    agent_id   TEXT    NOT NULL,
    node_name  TEXT    NOT NULL,
    pool       TEXT    NOT NULL,
    token_id   TEXT    NOT NULL,
    verdict    TEXT    NOT NULL,
    at         BIGINT  NOT NULL,
    details    TEXT    NOT NULL DEFAULT '{}'
);

CREATE INDEX joins_agent ON joins (agent_id, at);
