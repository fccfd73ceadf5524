"""Bootstrap tokens and their Secret manifest, against the reference format (node-agent.md §6.1/6.2)."""

from __future__ import annotations

import calendar
import dataclasses
import hashlib
import pickle

import pytest

from server.errors import ConfigError
from server.tokens.token import (
    EXTRA_GROUP_RE,
    KUBEADM_NODE_GROUP,
    TOKEN_RE,
    BootstrapToken,
    new_token,
    redact,
    rfc3339,
    secret_manifest,
    secret_name,
)

NOV30 = calendar.timegm((2026, 11, 30, 8, 0, 0))


def test_new_token_has_the_kubeadm_shape_and_ttl() -> None:
    token = new_token(ttl_s=900, now=1_000_000)
    assert TOKEN_RE.match(token.value)
    assert token.value == f"{token.token_id}.{token.secret}"
    assert token.expires_at == 1_000_900
    assert token.extra_groups == (KUBEADM_NODE_GROUP,)  # always: kubeadm's RBAC is bound to it
    assert token.secret_sha256 == hashlib.sha256(token.secret.encode()).hexdigest()


def test_a_pool_group_is_added_to_kubeadms_group_never_instead_of_it() -> None:
    """docs/join.md's pool (extra_groups: [its own group]) once minted tokens a kubeadm cluster refused."""
    pool = "system:bootstrappers:nodetrust:hgx-h200"
    assert new_token(ttl_s=60, now=1, extra_groups=(pool,)).extra_groups == (KUBEADM_NODE_GROUP, pool)
    both = new_token(ttl_s=60, now=1, extra_groups=(pool, KUBEADM_NODE_GROUP))
    assert both.extra_groups == (KUBEADM_NODE_GROUP, pool)
    assert secret_manifest(both)["stringData"]["auth-extra-groups"] == f"{KUBEADM_NODE_GROUP},{pool}"


def test_new_tokens_are_random() -> None:
    values = {new_token(ttl_s=60, now=0 + 1).value for _ in range(200)}
    assert len(values) == 200
    alphabet = set("".join(values).replace(".", ""))
    assert alphabet <= set("abcdefghijklmnopqrstuvwxyz0123456789")
    assert len(alphabet) > 30  # every character class is used


@pytest.mark.parametrize("ttl", [0, -5, True, 1.5])
def test_new_token_refuses_a_bad_ttl(ttl: object) -> None:
    with pytest.raises(ValueError, match=r"ttl_s"):
        new_token(ttl_s=ttl, now=0)  # type: ignore[arg-type]


def test_repr_and_str_never_show_the_secret() -> None:
    token = BootstrapToken("abcdef", "0123456789abcdef", NOV30, "desc")
    for text in (repr(token), str(token), f"{token}", f"{token!r}", repr([token]), repr({"t": token})):
        assert "0123456789abcdef" not in text
        assert "abcdef" in text
    assert str(token) == "abcdef.<redacted>"


def test_a_malformed_secret_is_refused_without_echoing_it() -> None:
    with pytest.raises(ValueError) as exc:
        BootstrapToken("abcdef", "NOT-A-SECRET-VAL", NOV30)
    assert "NOT-A-SECRET-VAL" not in str(exc.value)


@pytest.mark.parametrize("token_id", ["ABCDEF", "abcde", "abcdefg", "abc.ef", ""])
def test_a_malformed_id_is_refused(token_id: str) -> None:
    with pytest.raises(ValueError, match=r"token id"):
        BootstrapToken(token_id, "0123456789abcdef", NOV30)


def test_equality_is_by_value_and_the_secret_matters() -> None:
    a = BootstrapToken("abcdef", "0123456789abcdef", NOV30)
    assert a == BootstrapToken("abcdef", "0123456789abcdef", NOV30)
    assert a != BootstrapToken("abcdef", "0123456789abcdeg", NOV30)
    assert a.secret_matches("0123456789abcdef")
    assert not a.secret_matches("0123456789abcdeg")
    assert not a.secret_matches("")
    assert len({a, BootstrapToken("abcdef", "0123456789abcdef", NOV30)}) == 1


def test_the_token_is_immutable_and_survives_pickling() -> None:
    a = BootstrapToken("abcdef", "0123456789abcdef", NOV30)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.secret = "x"  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(a)) == a  # noqa: S301 - our own bytes


def test_rfc3339_is_utc_with_z() -> None:
    assert rfc3339(NOV30) == "2026-11-30T08:00:00Z"
    assert rfc3339(0) == "1970-01-01T00:00:00Z"


def test_secret_manifest_matches_the_reference_format() -> None:
    token = BootstrapToken(
        "abcdef",
        "0123456789abcdef",
        NOV30,
        description="nodetrust join of gpu-01 (h200)",
        extra_groups=(
            "system:bootstrappers:kubeadm:default-node-token",
            "system:bootstrappers:nodetrust:h200",
        ),
    )
    assert secret_manifest(token) == {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "bootstrap.kubernetes.io/token",
        "metadata": {
            "name": "bootstrap-token-abcdef",
            "namespace": "kube-system",
            "labels": {"app.kubernetes.io/managed-by": "nodetrust"},
        },
        "stringData": {
            "token-id": "abcdef",
            "token-secret": "0123456789abcdef",
            "expiration": "2026-11-30T08:00:00Z",
            "usage-bootstrap-authentication": "true",
            "usage-bootstrap-signing": "true",
            "auth-extra-groups": "system:bootstrappers:kubeadm:default-node-token,system:bootstrappers:nodetrust:h200",
            "description": "nodetrust join of gpu-01 (h200)",
        },
    }


def test_secret_manifest_values_are_all_strings() -> None:
    manifest = secret_manifest(BootstrapToken("abcdef", "0123456789abcdef", NOV30))
    assert all(isinstance(v, str) for v in manifest["stringData"].values())
    assert "auth-extra-groups" not in manifest["stringData"]  # none given: only system:bootstrappers


@pytest.mark.parametrize(
    "group",
    [
        "system:bootstrappers",
        "system:bootstrappers:",
        "system:bootstrappers:Upper",
        "system:bootstrappers:trailing-",
        "system:masters",
        "system:bootstrappers:a\n",
        "system:bootstrappers:" + "a" * 257,
    ],
)
def test_extra_groups_follow_the_authenticator_rule(group: str) -> None:
    assert not EXTRA_GROUP_RE.match(group)
    with pytest.raises(ConfigError, match=r"system:bootstrappers"):
        BootstrapToken("abcdef", "0123456789abcdef", NOV30, extra_groups=(group,))


@pytest.mark.parametrize(
    "group",
    [
        "system:bootstrappers:a",
        "system:bootstrappers:kubeadm:default-node-token",
        "system:bootstrappers:x-1:y",
    ],
)
def test_good_extra_groups(group: str) -> None:
    assert BootstrapToken("abcdef", "0123456789abcdef", NOV30, extra_groups=(group,)).extra_groups == (
        group,
    )


def test_secret_name_refuses_path_tricks() -> None:
    assert secret_name("abc123") == "bootstrap-token-abc123"
    for bad in ("../etc", "abc12/", "abc12\n", "ABC123"):
        with pytest.raises(ValueError):
            secret_name(bad)


def test_redact_hides_the_secret_and_token_shaped_text() -> None:
    token = BootstrapToken("abcdef", "0123456789abcdef", NOV30)
    text = "join with abcdef.0123456789abcdef, secret 0123456789abcdef, other zzzzzz.aaaaaaaaaaaaaaaa"
    out = redact(text, token)
    assert "0123456789abcdef" not in out
    assert "aaaaaaaaaaaaaaaa" not in out
    assert "abcdef.<redacted>" in out
    assert "zzzzzz.<redacted>" in out
