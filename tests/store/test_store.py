"""Every Store method, the same tests on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time

import pytest

from server.errors import NotFoundError, StoreError
from server.store import JoinRecord
from server.store.postgres import PostgresStore
from server.store.schema import load_migrations
from server.store.sql import SqlStore
from tests.store.conftest import OpenStore
from tests.store.helpers import FAR_FUTURE, agent, integrity_problems, raw_execute, raw_rows, token

A = "spiffe://example.org/spire/agent/tpm/aaaa"
B = "spiffe://example.org/spire/agent/tpm/bbbb"


# -- migrations ----------------------------------------------------------------


def test_migrate_is_idempotent_and_records_each_step(open_store: OpenStore, dsn: str) -> None:
    store = open_store()
    latest = len(load_migrations("sqlite"))
    assert store.migrate() == latest
    assert store.migrate() == latest
    assert open_store().migrate() == latest
    rows = raw_rows(dsn, "SELECT version, name FROM schema_version ORDER BY version")
    assert [r[0] for r in rows] == list(range(1, latest + 1))
    assert rows[0][1] == "init"
    assert store.schema_version() == latest


def test_calls_before_migrate_say_so(open_store: OpenStore) -> None:
    store = open_store()
    with pytest.raises(StoreError, match="migrate"):
        store.get_agent(A)


def test_a_newer_schema_is_refused(store: SqlStore, dsn: str) -> None:
    raw_execute(
        dsn, "INSERT INTO schema_version (version, name, applied_at) VALUES (%s, %s, %s)", (999, "future", 0)
    )
    with pytest.raises(StoreError, match="upgrade nodeserver"):
        store.migrate()


def test_both_dialects_have_the_same_migration_numbers() -> None:
    sqlite, postgres = load_migrations("sqlite"), load_migrations("postgresql")
    assert [(m.version, m.name) for m in sqlite] == [(m.version, m.name) for m in postgres]
    assert all(m.statements for m in sqlite)


# -- agents --------------------------------------------------------------------


def test_record_attestation_inserts_and_returns_the_row(store: SqlStore) -> None:
    record = agent(A, selectors=("tpm:pub_hash:aa", "tpm:ek_hash:bb"), can_reattest=False)
    assert store.record_attestation(record) == record
    assert store.get_agent(A) == record
    assert store.get_agent(B) is None


def test_record_attestation_keeps_first_attested_at(store: SqlStore) -> None:
    store.record_attestation(agent(A, at=100, svid_serial="1"))
    again = store.record_attestation(agent(A, at=200, svid_serial="2", selectors=(), svid_expires_at=900))
    assert again.first_attested_at == 100
    assert again.last_attested_at == 200
    assert again.svid_serial == "2"
    assert again.svid_expires_at == 900
    assert again.selectors == ()
    assert store.get_agent(A) == again


def test_record_attestation_never_clears_a_ban(store: SqlStore) -> None:
    store.record_attestation(agent(A))
    assert store.ban_agent(A) is True
    stored = store.record_attestation(agent(A, at=2_000_000_000, banned=False))
    assert stored.banned is True
    assert store.is_banned(A) is True
    assert stored.last_attested_at == 2_000_000_000


def test_record_attestations_writes_a_batch_in_one_transaction_and_skips_the_banned(
    store: SqlStore, dsn: str
) -> None:
    """The group commit's write (server/commit.py): per record None when it or another identity is banned."""
    c, ek_identity = A.replace("tpm/", "tpm/c"), "spiffe://example.org/spire/agent/tpm/" + "e" * 64
    store.record_attestation(agent(A, at=100))
    assert store.ban_agent(B) is True
    assert store.ban_agent(ek_identity) is True
    rows = store.record_attestations(
        [(agent(A, at=200, svid_serial="9"), ()), (agent(B, at=200), ()), (agent(c, at=200), (ek_identity,))]
    )
    assert rows[0] is not None and rows[0].first_attested_at == 100 and rows[0].svid_serial == "9"
    assert rows[1] is None and rows[2] is None
    placeholder = store.get_agent(B)
    assert placeholder is not None and placeholder.last_attested_at == 0  # nothing written for it
    assert store.get_agent(c) is None
    assert store.record_attestations([]) == []
    with pytest.raises(ValueError, match="spiffe_id"):
        store.record_attestations([(agent(A), ()), (agent(""), ())])
    assert store.get_agent(A) is not None and store.get_agent(A).svid_serial == "9"  # type: ignore[union-attr]
    assert integrity_problems(dsn) == []


def test_ban_of_an_unknown_agent_leaves_a_banned_placeholder(store: SqlStore, dsn: str) -> None:
    assert store.is_banned(B) is False
    assert store.ban_agent(B) is True
    assert store.ban_agent(B) is False  # no change
    assert store.is_banned(B) is True
    placeholder = store.get_agent(B)
    assert placeholder is not None and placeholder.banned and not placeholder.can_reattest
    assert integrity_problems(dsn) == []
    # It attests later (a race with the ban check): the ban stays, its real attestation time is kept.
    stored = store.record_attestation(agent(B, at=500))
    assert stored.banned is True
    assert stored.first_attested_at == 500
    assert stored.attestation_type == "tpm"


def test_unban(store: SqlStore) -> None:
    store.record_attestation(agent(A))
    assert store.unban_agent(A) is False  # was not banned
    store.ban_agent(A)
    assert store.unban_agent(A) is True
    assert store.is_banned(A) is False
    assert store.get_agent(A) is not None
    assert store.unban_agent(B) is False  # unknown
    store.ban_agent(B)
    assert store.unban_agent(B) is True  # a placeholder goes away with its ban
    assert store.get_agent(B) is None


def test_list_count_delete(store: SqlStore) -> None:
    assert store.list_agents() == []
    assert store.count_agents() == 0
    store.record_attestation(agent(B))
    store.record_attestation(agent(A))
    assert [a.spiffe_id for a in store.list_agents()] == [A, B]
    assert store.count_agents() == 2
    store.replace_token(token(A))
    assert store.delete_agent(A) is True
    assert store.delete_agent(A) is False
    assert store.count_agents() == 1
    assert store.live_token(A, 0) is None  # its tokens went with it


# -- tokens --------------------------------------------------------------------


def test_replace_token_returns_the_previous_live_token(store: SqlStore) -> None:
    store.record_attestation(agent(A))
    assert store.live_token(A, 0) is None
    first = token(A)
    assert store.replace_token(first) is None
    assert store.live_token(A, 0) == first
    second = token(A)
    assert store.replace_token(second) == first
    assert store.live_token(A, 0) == second


def test_replace_token_returns_an_expired_but_unrevoked_token_too(store: SqlStore) -> None:
    store.record_attestation(agent(A))
    old = token(A, expires_at=1000)
    store.replace_token(old)
    assert store.live_token(A, 2000) is None  # expired: not live for joining
    assert store.replace_token(token(A)) == old  # but still replaced, so the caller deletes it


def test_live_token_ignores_expired_and_revoked(store: SqlStore) -> None:
    store.record_attestation(agent(A))
    current = token(A, expires_at=1000)
    store.replace_token(current)
    assert store.live_token(A, 999) == current
    assert store.live_token(A, 1000) is None
    assert store.revoke_token(A, current.token_id) is True
    assert store.revoke_token(A, current.token_id) is False
    assert store.live_token(A, 0) is None
    assert store.replace_token(token(A)) is None  # nothing live to replace


def test_replace_token_for_an_unknown_agent(store: SqlStore) -> None:
    with pytest.raises(NotFoundError):
        store.replace_token(token(A))


def test_replace_token_is_all_or_nothing(store: SqlStore) -> None:
    store.record_attestation(agent(A))
    store.record_attestation(agent(B))
    current = token(A)
    store.replace_token(current)
    taken = token(B)
    store.replace_token(taken)
    # A token id already recorded (for another agent): the call fails and A keeps its live token.
    with pytest.raises(StoreError) as failure:
        store.replace_token(token(A, taken.token_id))
    assert failure.value.reason == "token_id_taken"
    assert store.live_token(A, 0) == current


def test_only_a_hash_of_the_secret_is_accepted(store: SqlStore, dsn: str) -> None:
    store.record_attestation(agent(A))
    with pytest.raises(ValueError, match="SHA-256"):
        store.replace_token(token(A, secret_sha256="0123456789abcdef"))  # a bootstrap secret itself
    assert raw_rows(dsn, "SELECT COUNT(*) FROM tokens") == [(0,)]


def test_the_database_itself_refuses_a_second_live_token(store: SqlStore, dsn: str) -> None:
    store.record_attestation(agent(A))
    store.replace_token(token(A))
    sql = (
        "INSERT INTO tokens (agent_id, token_id, secret_sha256, pool, node_name, issued_at, expires_at,"
        " revoked)"
        " VALUES (%s, %s, %s, 'p', 'n', 0, %s, FALSE)"
    )
    with pytest.raises(Exception, match=r"(?i)unique|duplicate") as refused:
        raw_execute(dsn, sql, (A, "zzzzzz", "0" * 64, FAR_FUTURE))
    assert (
        "IntegrityError" in type(refused.value).__name__ or "UniqueViolation" in type(refused.value).__name__
    )
    raw_execute(dsn, sql.replace("FALSE)", "TRUE)"), (A, "yyyyyy", "0" * 64, FAR_FUTURE))  # revoked: fine


def test_a_token_needs_its_agent_in_the_database(store: SqlStore, dsn: str) -> None:
    sql = (
        "INSERT INTO tokens (agent_id, token_id, secret_sha256, pool, node_name, issued_at, expires_at,"
        " revoked)"
        " VALUES (%s, 'orphan', %s, 'p', 'n', 0, 1, FALSE)"
    )
    with pytest.raises(Exception, match=r"(?i)foreign key"):
        raw_execute(dsn, sql, (B, "0" * 64))


def test_expired_tokens_and_forget(store: SqlStore) -> None:
    store.record_attestation(agent(A))
    store.record_attestation(agent(B))
    early, late, other = token(A, expires_at=100), token(A, expires_at=300), token(B, expires_at=200)
    store.replace_token(early)
    store.replace_token(late)  # early is revoked now, still recorded
    store.replace_token(other)
    assert list(store.expired_tokens(99)) == []
    assert list(store.expired_tokens(250)) == [early, other]
    assert list(store.expired_tokens(300)) == [early, other, late]
    store.forget_token(A, early.token_id)
    store.forget_token(A, other.token_id)  # wrong agent: nothing happens
    assert list(store.expired_tokens(300)) == [other, late]


def test_stale_tokens_are_the_revoked_and_the_expired(store: SqlStore) -> None:
    store.record_attestation(agent(A))
    store.record_attestation(agent(B))
    replaced, live, expired = (
        token(A, expires_at=FAR_FUTURE),
        token(A, expires_at=FAR_FUTURE),
        token(B, expires_at=200),
    )
    store.replace_token(replaced)
    store.replace_token(live)  # replaced is revoked: the backend may still hold it
    store.replace_token(expired)
    assert {t.token_id for t in store.stale_tokens(100)} == {replaced.token_id}
    assert {t.token_id for t in store.stale_tokens(300)} == {replaced.token_id, expired.token_id}
    assert store.revoke_token(A, live.token_id) is True
    assert {t.token_id for t in store.stale_tokens(100)} == {replaced.token_id, live.token_id}
    for t in (replaced, live, expired):
        store.forget_token(t.agent_id, t.token_id)
    assert list(store.stale_tokens(FAR_FUTURE + 1)) == []


# -- join requests and history -------------------------------------------------


def test_consume_request_id_refuses_a_replay(store: SqlStore) -> None:
    assert store.consume_request_id(A, "req-1", FAR_FUTURE) is True
    assert store.consume_request_id(A, "req-1", FAR_FUTURE) is False
    assert store.consume_request_id(B, "req-1", FAR_FUTURE) is True  # per agent
    assert store.consume_request_id(A, "req-2", FAR_FUTURE) is True


def test_expired_request_ids_are_pruned(open_store: OpenStore, dsn: str) -> None:
    now = [1000.0]
    store = open_store(clock=lambda: now[0])
    store.migrate()
    assert store.consume_request_id(A, "old", 1500) is True
    assert store.consume_request_id(A, "keep", 5000) is True
    now[0] = 2000.0
    assert (
        store.consume_request_id(A, "old", 1500) is False
    )  # still remembered: its own call never prunes it
    assert store.consume_request_id(B, "other", 5000) is True  # prunes "old"
    rows = raw_rows(dsn, "SELECT agent_id, request_id FROM join_requests ORDER BY agent_id, request_id")
    assert rows == [(A, "keep"), (B, "other")]


def test_joins_history(store: SqlStore) -> None:
    assert store.joins_for(A) == []
    second = JoinRecord(A, "node-1", "gpu", "tok002", "denied", 200, {"reason": "policy"})
    first = JoinRecord(A, "node-1", "gpu", "tok001", "ok", 100)
    other = JoinRecord(B, "node-2", "gpu", "tok003", "ok", 150)
    for record in (second, first, other):
        store.record_join(record)
    assert store.joins_for(A) == [first, second]
    assert store.joins_for(B) == [other]
    store.record_attestation(agent(A))
    store.delete_agent(A)
    assert store.joins_for(A) == [first, second]  # history outlives the agent


def test_joins_are_counted_per_agent_and_pruned(store: SqlStore) -> None:
    for at in (100, 200, 300):
        store.record_join(JoinRecord(A, "node-1", "gpu", f"tok{at}", "pass", at))
    store.record_join(JoinRecord(B, "node-2", "gpu", "tokb", "pass", 300))
    assert store.count_joins_since(A, 200) == 2
    assert store.count_joins_since(A, 301) == 0
    assert store.count_joins_since(B, 0) == 1
    assert store.prune_joins(250) == 2
    assert [j.at for j in store.joins_for(A)] == [300]
    assert store.prune_joins(250) == 0


# -- node lock -----------------------------------------------------------------


def test_node_lock_excludes_other_threads_and_is_reentrant(store: SqlStore) -> None:
    inside = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def holder() -> None:
        with store.node_lock(A):
            with store.node_lock(A):  # re-entrant in one thread
                order.append("holder")
            inside.set()
            release.wait(10)
            order.append("holder-done")

    def waiter() -> None:
        with store.node_lock(A):
            order.append("waiter")

    first = threading.Thread(target=holder)
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=waiter)
    second.start()
    with store.node_lock(B):  # another node is not held up
        order.append("other-node")
    time.sleep(0.2)
    release.set()
    first.join(10)
    second.join(10)
    assert order == ["holder", "other-node", "holder-done", "waiter"]


def test_node_lock_gives_up_after_its_timeout(open_store: OpenStore) -> None:
    holder_store = open_store()
    holder_store.migrate()
    waiter_store = open_store(lock_timeout=0.5)  # a second replica (own connections, own locks)
    with holder_store.node_lock(A):
        with pytest.raises(StoreError, match="lock"), waiter_store.node_lock(A):
            pytest.fail("the lock was granted twice")
        with waiter_store.node_lock(B):
            pass
    with waiter_store.node_lock(A):
        pass


@pytest.mark.postgres
def test_store_calls_inside_node_lock_use_the_lock_connection(pg_dsn: str) -> None:
    store = PostgresStore(pg_dsn, pool_size=1, pool_timeout=2)
    store.migrate()
    with store.node_lock(A):
        store.record_attestation(agent(A))
        store.replace_token(token(A))
        assert store.live_token(A, 0) is not None
    store.close()
