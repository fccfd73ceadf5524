"""``make demo-host``: the agent's steps on the host against an swtpm socket, without an image or a VM.

1. a TPM: swtpm, manufactured with an EK certificate from a local EK CA; a measured boot played into
   its PCRs as firmware and GRUB would (a SIMULATED boot: there is no firmware here), and its event log;
2. the server: ``nodeserver`` with a fresh trust domain trusting that EK CA and a CPU pool that
   admits only that boot's release (its boot-measurements.json);
3. ``nodeagent attest``; 4. ``nodeagent check`` against the CPU pool; 5. ``nodeagent run``: a quote
   over the server's nonce with the event log, join credentials and ``kubeadm join`` through the
   kubeadm TEST DOUBLE; 6. the token and the audit (the release the quote proved);
7. with ``tampered=True`` (``demo.py --host-only --tampered-boot``): the node "reboots" into another
   kernel command line and ``nodeagent reattest`` is refused, naming PCR 8.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from demo_common import (
    HOST_POOL,
    NODE_NAME,
    TRUST_DOMAIN,
    pool_profile_text,
    run,
    say,
    server_config,
    show_measured_boot,
    show_token_and_audit,
    step,
)

CMDLINE = "root=UUID=6e0c1c5a-3b7d-4c1e-9a55-2f7d0b1e8c42 ro console=ttyS0,115200"


def host_chain(work: Path, *, tampered: bool = False) -> int:
    from tests.support.measuredboot import fixture_boot
    from tests.support.swtpm import LocalCa, Swtpm, manufacture

    tpm: Swtpm | None = None
    try:
        step(1, f"A TPM: swtpm with an EK certificate from a local EK CA (in {work})")
        ca = LocalCa(work / "ek-ca")
        manufacture(work / "tpm", ca)
        tpm = Swtpm(work / "tpm").start()
        print(f"  swtpm listening, TCTI {tpm.tcti}")
        boot = fixture_boot(cmdline=CMDLINE)
        boot.extend_into(tpm.tcti)
        (work / "binary_bios_measurements").write_bytes(boot.log())
        reference = work / "release" / "boot-measurements.json"
        reference.parent.mkdir()
        boot.write_reference(reference, image="demo-release")
        print(
            f"  a SIMULATED measured boot extended into its PCRs 0-9; its event log: {work / 'binary_bios_measurements'}"
        )

        step(2, f"The server: a fresh trust domain {TRUST_DOMAIN}, trusting that EK CA, with a CPU pool that admits "
                "only the release whose boot-measurements.json it lists")  # fmt: skip
        ca.install_into(work / "server" / "ek-ca")
        config = work / "server" / "config.yaml"
        config.write_text(json.dumps(server_config(work, measurements=reference), indent=2))
        from tests.support.serverproc import ServerProcess

        print(f"  $ server.cli run --config {config}")
        with ServerProcess(None, config, log=work / "server.log") as server:
            port, join_port = server.attest_port, server.join_port
            print(f"  {server.line}")
            (work / "bundle.pem").write_bytes(server.bundle)
            print(f"  trust bundle (nodeserver bundle) written to {work / 'bundle.pem'}")

            step(3, "The agent attests the TPM and receives its X509-SVID")
            attest = run(
                [
                    sys.executable, "-m", "agent.cli", "attest",
                    "--server", f"127.0.0.1:{port}",
                    "--trust-domain", TRUST_DOMAIN,
                    "--bundle", str(work / "bundle.pem"),
                    "--tcti", tpm.tcti,
                    "--state-dir", str(work / "agent"),
                ]
            )  # fmt: skip
            say((attest.stdout + attest.stderr).strip())
            if attest.returncode != 0:
                return attest.returncode

            step(4, "The agent checks the GPUs and the node against the CPU pool")
            pool = work / "pool.yaml"
            pool.write_text(pool_profile_text(HOST_POOL))
            check = run([sys.executable, "-m", "agent.cli", "check", "--pool", str(pool)])
            say("\n".join(check.stdout.strip().splitlines()[-8:]))
            if check.returncode != 0:
                print(check.stderr, file=sys.stderr)
                return check.returncode

            step(5, "The agent asks for join credentials and runs kubeadm join (the kubeadm TEST DOUBLE)")
            from tests.support.kubeadm_double import install_kubeadm_double

            record = work / "kubeadm-calls.jsonl"
            kubeadm = install_kubeadm_double(work / "bin", record)
            env = {
                **os.environ,
                "NODEAGENT_SERVER": f"127.0.0.1:{port}",
                "NODEAGENT_JOIN_SERVER": f"127.0.0.1:{join_port}",
                "NODEAGENT_TRUST_DOMAIN": TRUST_DOMAIN,
                "NODEAGENT_BUNDLE": str(work / "bundle.pem"),
                "NODEAGENT_TCTI": tpm.tcti,
                "NODEAGENT_POOL": "cpu",
                "NODEAGENT_POOL_PROFILE": str(pool),
                "NODEAGENT_NODE_NAME": NODE_NAME,
                "NODEAGENT_STATE_DIR": str(work / "agent"),
                "NODEAGENT_KUBEADM": str(kubeadm),
                "NODEAGENT_JOIN_CONFIG": str(work / "run" / "kubeadm-join.yaml"),
                "NODEAGENT_EVENT_LOG": str(work / "binary_bios_measurements"),
            }
            joined = run(
                [sys.executable, "-m", "agent.cli", "-v", "run", "--config-dir", str(work / "etc")], env=env
            )
            say((joined.stderr + joined.stdout).strip())
            if joined.returncode != 0:
                return joined.returncode
            calls = [json.loads(line) for line in record.read_text().splitlines()]
            print("  the JoinConfiguration kubeadm received (the double redacts the token's secret half):")
            import yaml

            say(yaml.safe_dump(calls[-1]["config"], sort_keys=False), "    ")
            status = run(
                [sys.executable, "-m", "agent.cli", "status", "--config-dir", str(work / "etc")], env=env
            )
            say(status.stdout.strip())

            step(6, "The token, as the file backend wrote it for an operator to apply, and the audit trail")
            audit = show_token_and_audit(work)
            show_measured_boot(audit)
            if any(entry.get("result") != "ok" for entry in audit):
                return 1
            if tampered:
                step(
                    7,
                    "A tampered boot: the node reboots with init=/bin/sh on its command line and re-attests",
                )
                tpm.stop()
                tpm.start()  # a TPM reset: PCRs back to zero, keys kept
                env["NODEAGENT_TCTI"] = tpm.tcti
                evil = fixture_boot(cmdline=CMDLINE + " init=/bin/sh")
                evil.extend_into(tpm.tcti)
                (work / "binary_bios_measurements").write_bytes(evil.log())
                again = run([sys.executable, "-m", "agent.cli", "reattest", "--force", "--config-dir",
                             str(work / "etc")], env=env)  # fmt: skip
                say((again.stderr + again.stdout).strip())
                if again.returncode != 8 or "measurement_changed" not in again.stderr:
                    print("demo: the tampered boot was NOT refused", file=sys.stderr)
                    return 1
                print("  refused: the server names PCR 8 and the event that differs (exit 8, permanent)")
        print(
            "\n\033[1mdemo: the node proved its TPM identity, passed its checks, and joined with a one-time token.\033[0m"
        )
        return 0
    finally:
        if tpm is not None:
            tpm.stop()
