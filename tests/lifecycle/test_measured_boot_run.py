"""``nodeagent run`` and ``nodeagent reattest`` against a pool that checks measured boot, as separate processes.

The machine is a real swtpm whose PCRs hold a synthesised boot of the release the pool lists
(tests.support.measuredboot), and ``event_log`` points at that boot's TCG log. The node joins
through BeginJoin, the quote and RequestJoin; re-attesting later re-checks its boot. After a
"reboot" (the swtpm restarted: PCRs reset, keys kept) into a boot with another kernel command
line, the re-check is refused, ``measurement_changed``, and the exit status says it is permanent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.lifecycle.test_lifecycle import Node
from tests.support.joinenv import CPU_POOL, JoinEnv, start_join_env
from tests.support.kubeadm_double import install_kubeadm_double
from tests.support.measuredboot import fixture_boot, pool_measured_boot
from tests.support.swtpm import LocalCa, Swtpm, manufacture

pytestmark = [pytest.mark.swtpm, pytest.mark.subprocess]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[JoinEnv, LocalCa]]:
    base = tmp_path_factory.mktemp("mb-lifecycle-server")
    ref = base / "boot-measurements.json"
    sha = fixture_boot().write_reference(ref, image="rel-1")
    e = start_join_env(
        base, pools={"mb": {"profile": CPU_POOL, "measured_boot": pool_measured_boot(("rel-1", ref, sha))}}
    )
    ca = LocalCa(tmp_path_factory.mktemp("mb-lifecycle-ekca"))
    manufacture(tmp_path_factory.mktemp("warm"), ca)
    ca.install_into(e.base / "ek-ca")
    e.srv.app.ek_trust.reload()  # type: ignore[union-attr]
    yield e, ca
    e.srv.stop()


@pytest.fixture
def node(env: tuple[JoinEnv, LocalCa], tmp_path: Path) -> Iterator[Node]:
    join_env, ca = env
    manufacture(tmp_path / "tpm", ca)
    tpm = Swtpm(tmp_path / "tpm").start()
    (tmp_path / "etc").mkdir()
    (tmp_path / "bundle.pem").write_bytes(join_env.srv.bundle)
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump({"name": "cpu", **CPU_POOL}))
    kubeadm = install_kubeadm_double(tmp_path / "bin", tmp_path / "kubeadm-calls.jsonl")
    node = Node(join_env, tpm, tmp_path, kubeadm, tmp_path / "kubeadm-calls.jsonl", name="mb-worker")
    yield node
    node.tpm.stop()


def _boot(node: Node, cmdline: str = "root=UUID=1234 ro console=ttyS0") -> dict[str, str]:
    boot = fixture_boot(cmdline=cmdline)
    boot.extend_into(node.tpm.tcti)
    (node.dir / "binary_bios_measurements").write_bytes(boot.log())
    return {"NODEAGENT_POOL": "mb", "NODEAGENT_EVENT_LOG": str(node.dir / "binary_bios_measurements")}


def test_a_node_joins_a_measured_pool_and_is_refused_after_booting_something_else(node: Node) -> None:
    settings = _boot(node)
    first = node.run("run", extra_env=settings)
    assert first.returncode == 0, first.stderr
    assert len(node.kubeadm_calls()) == 1
    audit = node.env.srv.audit_lines()
    joined = [a for a in audit if a.get("result") == "ok" and a.get("release") == "rel-1"]
    assert joined, "the join's audit line names the release the boot matched"
    ak = json.loads((node.dir / "state" / "ak.json").read_text())

    # Before the SVID is due nothing happens; --force re-attests (a new AK) and re-checks the boot.
    idle = node.run("reattest", "--json", extra_env=settings)
    assert idle.returncode == 0, idle.stderr
    assert json.loads(idle.stdout)["action"] == "not_due"
    again = node.run("reattest", "--force", "--json", extra_env=settings)
    assert again.returncode == 0, again.stderr
    outcome = json.loads(again.stdout)
    assert outcome["action"] == "rechecked" and outcome["release"] == "rel-1"
    assert json.loads((node.dir / "state" / "ak.json").read_text()) != ak, "re-attestation keeps the new AK"

    # A reboot into another kernel command line: the TPM resets its PCRs; the firmware measures the new boot.
    node.tpm.stop()
    node.tpm.start()
    changed = _boot(node, cmdline="root=UUID=1234 ro console=ttyS0 init=/bin/sh")
    refused = node.run("reattest", "--force", extra_env=changed)
    assert refused.returncode == 8, refused.stderr  # join_refused: permanent
    assert "measurement_changed" in refused.stderr and "PCR 8" in refused.stderr
    last = node.env.srv.audit_lines()[-1]
    assert last["reason"] == "measurement_changed"
