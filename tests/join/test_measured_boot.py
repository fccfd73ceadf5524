"""A pool that checks measured boot admits only the boots its releases measure (issue 14, server side).

The node here is a software TPM double (tests/support/simtpm.py) whose AK the server really
credential-activated; its boot is a synthesised event log (protocol.eventlog.encode) and a quote
over the PCR values that log replays to. Every refusal gets its own reason, one audit line, and
leaves nothing granted.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from protocol import eventlog
from protocol._gen.nodetrust.join.v1 import join_pb2
from server.store import Enrolment
from tests.support.joinenv import CPU_POOL, JoinEnv, SimAgent, attest_sim, cpu_report, start_join_env
from tests.support.joinrpc import Refused, join_call
from tests.support.simtpm import SimulatedTpm

BANK = "sha256"
KERNEL = b"the image's kernel"
INITRD = b"the image's initrd"
GRUB_CFG = b"set timeout=0\nlinux /vmlinuz root=UUID=1234 ro console=ttyS0\ninitrd /initrd.img\nboot\n"
CMDLINE = "linux /vmlinuz root=UUID=1234 ro console=ttyS0"


def _h(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass
class Boot:
    """One boot: what firmware and GRUB measured, as (pcr, type, data, digest) rows."""

    rows: list[tuple[int, int, bytes, bytes]] = field(default_factory=list)

    def add(self, pcr: int, etype: int, data: bytes, digest: bytes | None = None) -> Boot:
        self.rows.append((pcr, etype, data, digest if digest is not None else _h(data)))
        return self

    def log(self, banks: tuple[str, ...] = (BANK,)) -> bytes:
        events = []
        for pcr, etype, data, digest in self.rows:
            digests = {b: (digest if b == BANK else hashlib.new(b, data).digest()) for b in banks}
            events.append((pcr, etype, digests, data))
        return eventlog.encode(banks, events)


def image_boot(
    *, cmdline: str = CMDLINE, kernel: bytes = KERNEL, shim: bytes = b"BOOTX64.EFI bytes"
) -> Boot:
    b = Boot()
    for pcr in range(8):  # firmware: not the image's, unchecked by the pool
        b.add(pcr, eventlog.EV_SEPARATOR, b"\x00\x00\x00\x00")
    b.add(0, eventlog.EV_POST_CODE, b"firmware volume", _h(b"this machine's firmware"))
    b.add(4, eventlog.EV_EFI_ACTION, b"Calling EFI Application from Boot Option")
    b.add(4, eventlog.EV_EFI_BOOT_SERVICES_APPLICATION, b"\x00" * 32, _h(shim))  # Authenticode stand-in
    b.add(8, eventlog.EV_IPL, b"grub_cmd: set timeout=0\x00", _h(b"set timeout=0"))
    b.add(8, eventlog.EV_IPL, f"grub_cmd: {cmdline}\x00".encode(), _h(cmdline.encode()))
    b.add(8, eventlog.EV_IPL, f"kernel_cmdline: {cmdline[6:]}\x00".encode(), _h(cmdline[6:].encode()))
    b.add(9, eventlog.EV_IPL, b"(hd0,gpt2)/boot/grub/grub.cfg\x00", _h(GRUB_CFG))
    b.add(9, eventlog.EV_IPL, b"/vmlinuz\x00", _h(kernel))
    b.add(9, eventlog.EV_IPL, b"/initrd.img\x00", _h(INITRD))
    return b


def reference(name: str = "k8s-1.36.3-test", *, kernel: bytes = KERNEL) -> dict[str, Any]:
    """The boot-measurements.json a build of the image would publish."""
    return {
        "schema": 1,
        "bank": BANK,
        "image": name,
        "pcrs": {
            "4": {
                "events": [
                    {"type": "EV_EFI_BOOT_SERVICES_APPLICATION", "digest": _h(b"BOOTX64.EFI bytes").hex(),
                     "what": "EFI/BOOT/BOOTX64.EFI"}
                ],
                "firmware": ["EV_EFI_ACTION", "EV_SEPARATOR"],
            },
            "8": {
                "events": [
                    {"type": "EV_IPL", "text": "grub_cmd: set timeout=0"},
                    {"type": "EV_IPL", "text": f"grub_cmd: {CMDLINE}"},
                    {"type": "EV_IPL", "text": f"kernel_cmdline: {CMDLINE[6:]}"},
                ],
                "firmware": ["EV_SEPARATOR"],
            },
            "9": {
                "events": [
                    {"type": "EV_IPL", "digest": _h(GRUB_CFG).hex(), "what": "/boot/grub/grub.cfg"},
                    {"type": "EV_IPL", "digest": _h(kernel).hex(), "what": "/vmlinuz"},
                    {"type": "EV_IPL", "digest": _h(INITRD).hex(), "what": "/initrd.img"},
                ],
                "firmware": ["EV_SEPARATOR"],
            },
        },
    }  # fmt: skip


def _write_reference(base: Path, doc: dict[str, Any], name: str) -> dict[str, str]:
    raw = json.dumps(doc).encode()
    path = base / f"{name}.boot-measurements.json"
    path.write_bytes(raw)
    return {"name": name, "measurements": str(path), "sha256": hashlib.sha256(raw).hexdigest()}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JoinEnv]:
    base = tmp_path_factory.mktemp("measured")
    base.mkdir(exist_ok=True)
    release = _write_reference(base, reference(), "k8s-1.36.3-test")
    other = _write_reference(base, reference("another-release", kernel=b"another kernel"), "another-release")
    pools = {
        "cpu": {"profile": CPU_POOL},
        "measured": {"profile": CPU_POOL, "measured_boot": {"releases": [release]}},
        "other": {"profile": CPU_POOL, "measured_boot": {"releases": [other]}},
        "strict": {"profile": CPU_POOL, "measured_boot": {"releases": [release], "on_change": "ban"}},
        "enrolled": {"profile": CPU_POOL, "require_enrolment": True},
    }
    e = start_join_env(base, pools=pools)
    yield e
    e.srv.stop()


@pytest.fixture
def agent(env: JoinEnv, tmp_path: Path) -> SimAgent:
    return attest_sim(env.srv, SimulatedTpm.create(env.ek_ca), tmp_path / "agent")


def begin(env: JoinEnv, agent: SimAgent, pool: str = "measured") -> join_pb2.BeginJoinResponse:
    answer: join_pb2.BeginJoinResponse = join_call(
        env, agent, "BeginJoin", join_pb2.BeginJoinRequest(pool=pool), join_pb2.BeginJoinResponse
    )
    return answer


def values_of(log: bytes, pcrs: list[int]) -> dict[int, bytes]:
    parsed = eventlog.parse(log)
    replayed = parsed.replay(BANK)
    return {p: replayed.get(p, eventlog.initial_value(p, 32)) for p in pcrs}


def request_join(
    env: JoinEnv,
    agent: SimAgent,
    *,
    pool: str = "measured",
    boot: Boot | None = None,
    log: bytes | None = None,
    nonce: bytes | None = None,
    quoter: SimulatedTpm | None = None,
    quote: tuple[bytes, bytes] | None = None,
    node_name: str | None = None,
    report: bytes | None = None,
) -> join_pb2.JoinResponse:
    answer = begin(env, agent, pool)
    log = log if log is not None else (boot or image_boot()).log()
    n = answer.nonce if nonce is None else nonce
    if quote is None:
        quote = (quoter or agent.sim).quote(n, values_of(log, list(answer.pcrs)))
    req = join_pb2.JoinRequest(
        pool=pool,
        node_name=node_name or agent.node_name,
        report=report or cpu_report(),
        request_id=secrets.token_hex(16),
        requested_at=int(time.time()),
        nonce=n,
        quote=quote[0],
        quote_signature=quote[1],
        event_log=log,
    )
    grant: join_pb2.JoinResponse = join_call(env, agent, "RequestJoin", req, join_pb2.JoinResponse)
    return grant


def _no_token(env: JoinEnv, agent: SimAgent) -> bool:
    store = env.srv.app.store
    assert store is not None
    return store.live_token(agent.spiffe_id, int(time.time())) is None


def test_begin_join_names_the_pcrs_and_a_pool_without_measured_boot_needs_none(
    env: JoinEnv, agent: SimAgent
) -> None:
    answer = begin(env, agent)
    assert len(answer.nonce) == 32 and answer.pcr_bank == BANK
    assert list(answer.pcrs) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # checked 4, 8, 9 + unchecked firmware PCRs
    plain = begin(env, agent, "cpu")
    assert plain.nonce == b"" and list(plain.pcrs) == []


def test_the_image_boot_is_admitted(env: JoinEnv, agent: SimAgent) -> None:
    grant = request_join(env, agent)
    assert grant.token
    line = [a for a in env.srv.audit_lines() if a["event"] == "join"][-1]
    assert line["result"] == "ok" and line["release"] == "k8s-1.36.3-test"
    assert line["checked_pcrs"] == [4, 8, 9] and line["unchecked_pcrs"] == [0, 1, 2, 3, 5, 6, 7]


def test_the_image_boot_on_another_disk_is_admitted(env: JoinEnv, agent: SimAgent) -> None:
    """GRUB's device names follow the firmware's disk order: (hd3,gpt2) is the same boot."""
    boot = image_boot()
    pcr, etype, _data, digest = boot.rows[-3]
    boot.rows[-3] = (pcr, etype, b"(hd3,gpt2)/boot/grub/grub.cfg\x00", digest)
    assert request_join(env, agent, boot=boot).token


def _refused(env: JoinEnv, agent: SimAgent, reason: str, **kwargs: Any) -> Refused:
    before = len(env.srv.audit_lines())
    with pytest.raises(Refused) as refused:
        request_join(env, agent, **kwargs)
    assert refused.value.reason == reason, refused.value
    lines = [a for a in env.srv.audit_lines()[before:] if a["event"] == "join"]
    assert len(lines) == 1 and lines[0]["reason"] == reason, lines
    assert _no_token(env, agent)
    return refused.value


def test_a_modified_kernel_command_line_is_refused_naming_pcr_8(env: JoinEnv, agent: SimAgent) -> None:
    refused = _refused(env, agent, "boot_not_accepted", boot=image_boot(cmdline=CMDLINE + " init=/bin/sh"))
    assert (
        refused.status == "PERMISSION_DENIED"
        and "PCR 8" in refused.message
        and "init=/bin/sh" in refused.message
    )


def test_a_modified_kernel_is_refused_naming_pcr_9(env: JoinEnv, agent: SimAgent) -> None:
    refused = _refused(env, agent, "boot_not_accepted", boot=image_boot(kernel=b"a patched kernel"))
    assert "PCR 9" in refused.message and "/vmlinuz" in refused.message


def test_another_boot_loader_is_refused_naming_pcr_4(env: JoinEnv, agent: SimAgent) -> None:
    refused = _refused(env, agent, "boot_not_accepted", boot=image_boot(shim=b"someone else's loader"))
    assert "PCR 4" in refused.message


def test_a_release_the_pool_does_not_list_is_refused(env: JoinEnv, agent: SimAgent) -> None:
    refused = _refused(env, agent, "boot_not_accepted", pool="other")
    assert "another-release" in refused.message


def test_a_quote_with_a_wrong_signature_is_refused(env: JoinEnv, agent: SimAgent) -> None:
    from cryptography.hazmat.primitives.asymmetric import rsa

    answer = begin(env, agent)
    log = image_boot().log()
    quote = agent.sim.quote(answer.nonce, values_of(log, list(answer.pcrs)),
                            sign_with=rsa.generate_private_key(65537, 2048))  # fmt: skip
    _refused(env, agent, "quote_signature", log=log, nonce=answer.nonce, quote=quote)


def test_a_quote_from_another_ak_is_refused(env: JoinEnv, agent: SimAgent) -> None:
    """A second machine's TPM quotes the image's boot: the quote is not this agent's."""
    _refused(env, agent, "quote_signature", quoter=SimulatedTpm.create(env.ek_ca))


def test_a_stale_or_foreign_nonce_is_refused(env: JoinEnv, agent: SimAgent, tmp_path: Path) -> None:
    _refused(env, agent, "quote_nonce", nonce=secrets.token_bytes(32))  # never issued
    other = attest_sim(env.srv, SimulatedTpm.create(env.ek_ca), tmp_path / "other")
    foreign = begin(env, other).nonce
    _refused(env, agent, "quote_nonce", nonce=foreign)  # another agent's
    # A nonce is used once: a replayed join with the same nonce and quote is refused.
    answer = begin(env, agent)
    log = image_boot().log()
    quote = agent.sim.quote(answer.nonce, values_of(log, list(answer.pcrs)))
    fields: dict[str, Any] = {"log": log, "nonce": answer.nonce, "quote": quote}
    assert request_join(env, agent, **fields).token
    store = env.srv.app.store
    assert store is not None
    store.revoke_token(agent.spiffe_id, store.live_token(agent.spiffe_id, int(time.time())).token_id)  # type: ignore[union-attr]
    _refused(env, agent, "quote_nonce", **fields)


def test_an_event_log_that_does_not_replay_to_the_quote_is_refused(env: JoinEnv, agent: SimAgent) -> None:
    """The image's log, sent with a quote of what this machine really booted."""
    answer = begin(env, agent)
    really = image_boot(kernel=b"what the machine really booted").log()
    quote = agent.sim.quote(answer.nonce, values_of(really, list(answer.pcrs)))
    _refused(env, agent, "eventlog_replay", log=image_boot().log(), nonce=answer.nonce, quote=quote)


def test_a_sha1_only_log_is_refused_where_sha256_is_required(env: JoinEnv, agent: SimAgent) -> None:
    answer = begin(env, agent)
    quote = agent.sim.quote(answer.nonce, {p: bytes(32) for p in answer.pcrs})
    refused = _refused(
        env, agent, "quote_bank", log=image_boot().log(banks=("sha1",)), nonce=answer.nonce, quote=quote
    )
    assert "sha256" in refused.message


def test_a_selection_smaller_than_the_policy_is_refused(env: JoinEnv, agent: SimAgent) -> None:
    answer = begin(env, agent)
    log = image_boot().log()
    values = values_of(log, [4, 8, 9])  # leaves out the firmware PCRs the policy quotes
    quote = agent.sim.quote(answer.nonce, values)
    _refused(env, agent, "quote_selection", log=log, nonce=answer.nonce, quote=quote)


def test_a_garbage_event_log_is_refused(env: JoinEnv, agent: SimAgent) -> None:
    answer = begin(env, agent)
    quote = agent.sim.quote(answer.nonce, {p: bytes(32) for p in answer.pcrs})
    _refused(env, agent, "eventlog_malformed", log=b"\x00" * 64, nonce=answer.nonce, quote=quote)


def test_no_quote_for_a_measured_pool_is_refused(env: JoinEnv, agent: SimAgent) -> None:
    begin(env, agent)
    req = join_pb2.JoinRequest(
        pool="measured",
        node_name=agent.node_name,
        report=cpu_report(),
        request_id=secrets.token_hex(16),
        requested_at=int(time.time()),
    )
    with pytest.raises(Refused) as refused:
        join_call(env, agent, "RequestJoin", req, join_pb2.JoinResponse)
    assert refused.value.status == "INVALID_ARGUMENT" and refused.value.reason == "quote_missing"


def test_a_forged_healthy_report_from_a_machine_that_booted_something_else(
    env: JoinEnv, agent: SimAgent
) -> None:
    """A trusted TPM on a machine not running the image sends a perfect report: its boot is what gives it away."""
    _refused(
        env,
        agent,
        "boot_not_accepted",
        boot=image_boot(kernel=b"the attacker's kernel"),
        report=cpu_report(),
    )


def test_a_second_machine_cannot_take_a_joined_node_name(
    env: JoinEnv, agent: SimAgent, tmp_path: Path
) -> None:
    """Once, a second attested machine got a live token for a name another machine had joined as."""
    from tests.support.joinenv import join

    join(env, agent)
    thief = attest_sim(env.srv, SimulatedTpm.create(env.ek_ca), tmp_path / "thief")
    from agent.errors import AgentError

    with pytest.raises(AgentError):
        join(env, thief, node_name=agent.node_name)
    line = [a for a in env.srv.audit_lines() if a["event"] == "join"][-1]
    assert line["reason"] == "node_name_taken" and line["spiffe_id"] == thief.spiffe_id
    assert line["status"] == "PERMISSION_DENIED"
    assert _no_token(env, thief)
    # Released by an operator, the name can be taken by the new machine.
    store = env.srv.app.store
    assert store is not None and store.release_node_name(agent.node_name)
    assert join(env, thief, node_name=agent.node_name).token


def test_a_pool_can_require_enrolment(env: JoinEnv, agent: SimAgent) -> None:
    from agent.errors import AgentError
    from tests.support.joinenv import join

    with pytest.raises(AgentError):
        join(env, agent, pool="enrolled")
    line = [a for a in env.srv.audit_lines() if a["event"] == "join"][-1]
    assert (line["reason"], line["status"]) == ("not_enrolled", "PERMISSION_DENIED")
    store = env.srv.app.store
    assert store is not None
    store.enrol(Enrolment(agent.sim.ek_hash, "rack7-node3", "enrolled", serial="SN123", enrolled_at=1))
    with pytest.raises(AgentError):
        join(env, agent, pool="enrolled")  # enrolled under another name
    assert [a for a in env.srv.audit_lines() if a["event"] == "join"][-1]["reason"] == "enrolment_mismatch"
    assert join(env, agent, pool="enrolled", node_name="rack7-node3").token


def recheck(
    env: JoinEnv, agent: SimAgent, pool: str, boot: Boot, node_name: str | None = None
) -> join_pb2.RecheckResponse:
    answer = begin(env, agent, pool)
    log = boot.log()
    quote = agent.sim.quote(answer.nonce, values_of(log, list(answer.pcrs)))
    req = join_pb2.RecheckRequest(
        pool=pool, node_name=node_name or agent.node_name, nonce=answer.nonce, quote=quote[0], quote_signature=quote[1],
        event_log=log,
    )  # fmt: skip
    reply: join_pb2.RecheckResponse = join_call(env, agent, "Recheck", req, join_pb2.RecheckResponse)
    return reply


def test_a_joined_node_is_rechecked_and_a_changed_boot_refused(env: JoinEnv, agent: SimAgent) -> None:
    assert request_join(env, agent).token
    assert recheck(env, agent, "measured", image_boot()).release == "k8s-1.36.3-test"
    with pytest.raises(Refused) as refused:
        recheck(env, agent, "measured", image_boot(kernel=b"a kernel swapped after the join"))
    assert (refused.value.status, refused.value.reason) == ("PERMISSION_DENIED", "measurement_changed")
    line = env.srv.audit_lines()[-1]
    assert line["event"] == "recheck" and line["reason"] == "measurement_changed" and line["banned"] is False
    store = env.srv.app.store
    assert store is not None and not store.is_banned(agent.spiffe_id)


def test_a_pool_can_ban_a_node_whose_boot_changed(env: JoinEnv, agent: SimAgent) -> None:
    assert request_join(env, agent, pool="strict").token
    with pytest.raises(Refused) as refused:
        recheck(env, agent, "strict", image_boot(cmdline=CMDLINE + " nokaslr"))
    assert refused.value.reason == "measurement_changed" and "banned" in refused.value.message
    store = env.srv.app.store
    assert store is not None and store.is_banned(agent.spiffe_id)
    assert _no_token(env, agent)


def test_a_recheck_for_another_machines_name_is_refused(
    env: JoinEnv, agent: SimAgent, tmp_path: Path
) -> None:
    assert request_join(env, agent).token
    other = attest_sim(env.srv, SimulatedTpm.create(env.ek_ca), tmp_path / "other")
    with pytest.raises(Refused) as refused:
        recheck(env, other, "measured", image_boot(), node_name=agent.node_name)
    assert (refused.value.status, refused.value.reason) == ("PERMISSION_DENIED", "node_name_taken")
