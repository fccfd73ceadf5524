"""Numbered schema migrations, read by ``server.store.schema``.

``NNNN_name.sql`` is written in the SQL subset SQLite and PostgreSQL share and
applies to both; ``NNNN_name.sqlite.sql`` / ``NNNN_name.postgresql.sql`` hold a
step that has to differ per dialect (both must then exist). Statements are
separated by ``;`` at the end of a line; no statement may contain a ``;`` of its
own (no triggers, no string literals with semicolons). A migration, once
released, is never edited: add the next number instead.
"""
