"""The server's store: SQLite (default) or PostgreSQL, one schema, one interface."""

from server.store.base import AgentRecord, JoinRecord, Store, TokenRecord

__all__ = ["AgentRecord", "JoinRecord", "Store", "TokenRecord"]
