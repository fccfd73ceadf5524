"""``make demo``: the chain end to end on loopback, printing each step.

1. a fresh trust domain: ``nodeserver`` with a new CA, trusting a local EK CA;
2. a TPM: swtpm, manufactured with an EK certificate from that EK CA;
3. ``nodeagent attest`` proves the TPM to the server and gets its X509-SVID;
4. the server's audit line for that attestation.

Everything runs from a temporary folder and is stopped and removed at the end,
even on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRUST_DOMAIN = "demo.nodetrust.test"


def step(n: int, text: str) -> None:
    print(f"\n\033[1m[{n}] {text}\033[0m", flush=True)


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    print("  $ " + " ".join(argv[2:] if argv[:2] == [sys.executable, "-m"] else argv), flush=True)
    return subprocess.run(argv, text=True, capture_output=True, cwd=ROOT, check=False, **kwargs)  # type: ignore[call-overload,no-any-return]


@contextlib.contextmanager
def nodeserver(config: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "run", "--config", str(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        port = 0
        deadline = time.monotonic() + 60
        if proc.stdout is None:
            raise SystemExit("nodeserver has no stdout pipe")
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("nodeserver: serving"):
                print("  " + line.strip())
                port = int(line.split(" on port ")[1].split(",")[0])
                break
        if port == 0:
            raise SystemExit(f"nodeserver did not start (exit {proc.poll()})")
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


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

        step(2, f"The server: a fresh trust domain {TRUST_DOMAIN}, trusting that EK CA")
        ca.install_into(work / "server" / "ek-ca")
        config = work / "server" / "config.yaml"
        config.write_text(
            json.dumps(
                {
                    "trust_domain": TRUST_DOMAIN,
                    "data_dir": str(work / "server" / "data"),
                    "listen": "127.0.0.1:0",
                    "metrics_listen": "off",
                    "ek_trust": {"ca_dir": str(work / "server" / "ek-ca")},
                },
                indent=2,
            )
        )
        with nodeserver(config) as (_server, port):
            bundle = run([sys.executable, "-m", "server.cli", "bundle", "--config", str(config)])
            if bundle.returncode != 0:
                print(bundle.stderr, file=sys.stderr)
                return 1
            (work / "bundle.pem").write_text(bundle.stdout)
            print(f"  trust bundle written to {work / 'bundle.pem'}")

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

            step(4, "The server's audit line for that attestation")
            audit = (work / "server" / "data" / "audit.jsonl").read_text().strip().splitlines()
            print("  " + audit[-1])
            if json.loads(audit[-1]).get("result") != "ok":
                return 1
        print("\n\033[1mdemo: the node proved its TPM identity and holds an agent SVID.\033[0m")
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
