"""``make demo``: the chain end to end on loopback, printing each step.

1. a TPM: swtpm, manufactured with an EK certificate from a local EK CA;
2. a fresh trust domain: ``nodeserver`` with a new CA, trusting that EK CA, with a CPU node
   pool, a stand-in cluster CA and the ``file`` bootstrap-token backend;
3. ``nodeagent attest`` proves the TPM to the server and gets its X509-SVID;
4. ``nodeagent check`` runs the GPU and node checks against the CPU pool;
5. ``nodeagent run`` verifies, asks the join broker for credentials over mutual TLS and runs
   ``kubeadm join`` (the kubeadm TEST DOUBLE: no cluster can run here), which prints the
   JoinConfiguration it received;
6. the token as the file backend wrote it (the Secret manifest an operator would apply),
   and the server's audit lines.

Everything runs from a temporary folder and is stopped and removed at the end,
even on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRUST_DOMAIN = "demo.nodetrust.test"


def step(n: int, text: str) -> None:
    print(f"\n\033[1m[{n}] {text}\033[0m", flush=True)


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    print("  $ " + " ".join(argv[2:] if argv[:2] == [sys.executable, "-m"] else argv), flush=True)
    return subprocess.run(argv, text=True, capture_output=True, cwd=ROOT, check=False, **kwargs)  # type: ignore[call-overload,no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder for inspection")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.support.swtpm import LocalCa, Swtpm, manufacture, missing_tools

    missing = missing_tools()
    if missing:
        print(
            f"demo: missing {', '.join(missing)}; run `make deps` (installs swtpm and swtpm-tools)",
            file=sys.stderr,
        )
        return 1
    work = Path(tempfile.mkdtemp(prefix="nodetrust-demo-"))
    tpm: Swtpm | None = None
    try:
        step(1, f"A TPM: swtpm with an EK certificate from a local EK CA (in {work})")
        ca = LocalCa(work / "ek-ca")
        manufacture(work / "tpm", ca)
        tpm = Swtpm(work / "tpm").start()
        print(f"  swtpm listening, TCTI {tpm.tcti}")

        step(2, f"The server: a fresh trust domain {TRUST_DOMAIN}, trusting that EK CA, with a CPU pool")
        ca.install_into(work / "server" / "ek-ca")
        from tests.support.joinenv import cluster_ca

        cluster_ca(work / "server" / "cluster-ca.pem")
        config = work / "server" / "config.yaml"
        config.write_text(
            json.dumps(
                {
                    "trust_domain": TRUST_DOMAIN,
                    "data_dir": str(work / "server" / "data"),
                    "listen": "127.0.0.1:0",
                    "join_listen": "127.0.0.1:0",
                    "metrics_listen": "off",
                    "ek_trust": {"ca_dir": str(work / "server" / "ek-ca")},
                    "cluster": {
                        "api_server_endpoint": "192.0.2.10:6443",
                        "ca_cert": str(work / "server" / "cluster-ca.pem"),
                        "kubernetes_version": "v1.36.3",
                    },
                    "join": {"token_ttl": "15m"},
                    "token_backend": {"type": "file", "directory": str(work / "server" / "tokens")},
                    "pools": {"cpu": {"profile": {"preset": "cpu", "checks": {"warn": ["node.*"]}}}},
                },
                indent=2,
            )
        )
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
            print("  " + (attest.stdout + attest.stderr).strip().replace("\n", "\n  "))
            if attest.returncode != 0:
                return attest.returncode

            step(4, "The agent checks the GPUs and the node against the CPU pool")
            pool = work / "pool.yaml"
            pool.write_text("name: cpu\npreset: cpu\nchecks:\n  warn: ['node.*']\n")
            check = run([sys.executable, "-m", "agent.cli", "check", "--pool", str(pool)])
            print("  " + "\n  ".join(check.stdout.strip().splitlines()[-8:]))
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
                "NODEAGENT_NODE_NAME": "demo-node-1",
                "NODEAGENT_STATE_DIR": str(work / "agent"),
                "NODEAGENT_KUBEADM": str(kubeadm),
                "NODEAGENT_JOIN_CONFIG": str(work / "run" / "kubeadm-join.yaml"),
            }
            joined = run(
                [sys.executable, "-m", "agent.cli", "-v", "run", "--config-dir", str(work / "etc")], env=env
            )
            for line in (joined.stderr + joined.stdout).strip().splitlines():
                print("  " + line)
            if joined.returncode != 0:
                return joined.returncode
            calls = [json.loads(line) for line in record.read_text().splitlines()]
            print("  the JoinConfiguration kubeadm received (the double redacts the token's secret half):")
            import yaml

            print(
                "    "
                + yaml.safe_dump(calls[-1]["config"], sort_keys=False).replace("\n", "\n    ").rstrip()
            )
            status = run(
                [sys.executable, "-m", "agent.cli", "status", "--config-dir", str(work / "etc")], env=env
            )
            print("  " + status.stdout.strip().replace("\n", "\n  "))

            step(6, "The token, as the file backend wrote it for an operator to apply, and the audit trail")
            for manifest in sorted((work / "server" / "tokens").glob("*.yaml")):
                print(f"  {manifest} (mode {oct(manifest.stat().st_mode & 0o777)}):")
                print("    " + manifest.read_text().strip().replace("\n", "\n    "))
            audit = (work / "server" / "data" / "audit.jsonl").read_text().strip().splitlines()
            for line in audit:
                print("  " + line)
            if any(json.loads(line).get("result") != "ok" for line in audit):
                return 1
        print(
            "\n\033[1mdemo: the node proved its TPM identity, passed its checks, and joined with a one-time token.\033[0m"
        )
        return 0
    finally:
        if tpm is not None:
            tpm.stop()
        if args.keep:
            print(f"demo: kept {work}")
        else:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
