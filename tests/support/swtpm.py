"""Real swtpm TPMs for tests and the demo: manufactured with EK certificates from a local CA.

:class:`LocalCa` is a swtpm-localca configuration in a folder of its own; the
CA (root and issuing certificate) is created by swtpm-localca on first use.
:func:`manufacture` runs ``swtpm_setup`` (EK created, EK certificate issued by
that CA and written to NV, NV locked), and :class:`Swtpm` serves a state
folder on a random loopback port pair for the ``swtpm:`` TCTI, or with ``unix=True`` on a UNIX
socket (``<dir>/tpm.sock``, control ``tpm.sock.ctrl``): the form SPIRE's Go TPM library opens
(``tpm_device_path``), which the ``swtpm:path=`` TCTI also takes.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REQUIRED = ("swtpm", "swtpm_setup", "/usr/share/swtpm/swtpm-localca")


def missing_tools() -> list[str]:
    return [t for t in REQUIRED if not (shutil.which(t) or os.path.exists(t))]


def require_tools() -> None:
    missing = missing_tools()
    if missing:
        raise RuntimeError(
            f"swtpm tools missing: {', '.join(missing)}; install the Debian packages swtpm and swtpm-tools"
        )


@dataclass
class LocalCa:
    """A swtpm-localca CA living in ``dir``."""

    dir: Path

    def __post_init__(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "localca.conf").write_text(
            f"statedir = {self.dir}\n"
            f"signingkey = {self.dir}/signkey.pem\n"
            f"issuercert = {self.dir}/issuercert.pem\n"
            f"certserial = {self.dir}/certserial\n"
        )
        (self.dir / "localca.options").write_text(
            "--platform-manufacturer nodetrust-tests\n--platform-version 2.1\n--platform-model swtpm\n"
        )
        (self.dir / "swtpm_setup.conf").write_text(
            "create_certs_tool = /usr/share/swtpm/swtpm-localca\n"
            f"create_certs_tool_config = {self.dir}/localca.conf\n"
            f"create_certs_tool_options = {self.dir}/localca.options\n"
            "active_pcr_banks = sha256\n"
        )

    @property
    def setup_config(self) -> Path:
        return self.dir / "swtpm_setup.conf"

    @property
    def root_cert(self) -> Path:
        return self.dir / "swtpm-localca-rootca-cert.pem"

    @property
    def issuer_cert(self) -> Path:
        return self.dir / "issuercert.pem"

    def install_into(self, ca_dir: Path) -> None:
        """Copy the CA certificates into a server's ek_trust.ca_dir (after the first manufacture)."""
        ca_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.root_cert, ca_dir / "swtpm-localca-root.pem")
        shutil.copy(self.issuer_cert, ca_dir / "swtpm-localca-issuer.pem")


def manufacture(state_dir: Path, ca: LocalCa | None) -> None:
    """Create a TPM state with an RSA-2048 EK (and its certificate when ``ca`` is given)."""
    require_tools()
    state_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        "swtpm_setup",
        "--tpm2",
        "--tpmstate",
        str(state_dir),
        "--createek",
        "--decryption",
        "--overwrite",
        "--pcr-banks",
        "sha256",
    ]
    if ca is not None:
        argv += ["--create-ek-cert", "--lock-nvram", "--config", str(ca.setup_config)]
    else:
        argv += ["--config", str(_empty_config(state_dir))]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"swtpm_setup failed ({proc.returncode}): {proc.stdout}{proc.stderr}")


def _empty_config(state_dir: Path) -> Path:
    path = state_dir.parent / f"{state_dir.name}-setup.conf"
    path.write_text("active_pcr_banks = sha256\n")
    return path


def _port_pair_free(port: int) -> bool:
    for p in (port, port + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


@dataclass
class Swtpm:
    """A running ``swtpm socket`` serving ``state_dir`` on 127.0.0.1:port (control on port+1), or with
    ``unix`` on ``socket_path`` (in a short private folder of its own: sun_path holds 108 bytes)."""

    state_dir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    unix: bool = False
    socket_path: Path | None = None

    @property
    def tcti(self) -> str:
        if self.unix:
            return f"swtpm:path={self.socket_path}"
        return f"swtpm:host=127.0.0.1,port={self.port}"

    @property
    def device_path(self) -> Path:
        """The data socket, for SPIRE's ``tpm_device_path`` (UNIX mode only)."""
        if self.socket_path is None:
            raise RuntimeError("this swtpm serves TCP: start it with unix=True for SPIRE's go-tpm")
        return self.socket_path

    def _start_unix(self, log: Path) -> Swtpm:
        folder = Path(tempfile.mkdtemp(prefix="nt-swtpm-"))  # 0700
        sock = folder / "tpm.sock"
        proc = subprocess.Popen(
            [
                "swtpm",
                "socket",
                "--tpm2",
                "--tpmstate",
                f"dir={self.state_dir}",
                "--server",
                f"type=unixio,path={sock}",
                "--ctrl",
                f"type=unixio,path={sock}.ctrl",
                "--flags",
                "not-need-init,startup-clear",
                "--log",
                f"file={log},level=1",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            if sock.exists():
                try:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                        s.settimeout(0.2)
                        s.connect(str(sock))
                    self.socket_path, self.proc = sock, proc
                    return self
                except OSError:
                    pass
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"swtpm did not start on {sock}; see {log}")

    def start(self, attempts: int = 20) -> Swtpm:
        require_tools()
        log = self.state_dir.parent / f"{self.state_dir.name}-swtpm.log"
        if self.unix:
            return self._start_unix(log)
        for _ in range(attempts):
            port = random.randrange(20000, 60000, 2)
            if not _port_pair_free(port):
                continue
            proc = subprocess.Popen(
                [
                    "swtpm",
                    "socket",
                    "--tpm2",
                    "--tpmstate",
                    f"dir={self.state_dir}",
                    "--server",
                    f"type=tcp,port={port},bindaddr=127.0.0.1",
                    "--ctrl",
                    f"type=tcp,port={port + 1},bindaddr=127.0.0.1",
                    "--flags",
                    "not-need-init,startup-clear",
                    "--log",
                    f"file={log},level=1",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                        self.port, self.proc = port, proc
                        return self
                except OSError:
                    time.sleep(0.05)
            proc.kill()
            proc.wait()
        raise RuntimeError(f"swtpm did not start after {attempts} attempts; see {log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.socket_path is not None:
            shutil.rmtree(self.socket_path.parent, ignore_errors=True)
            self.socket_path = None

    def __enter__(self) -> Swtpm:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


ECC_EK_CERT_INDEX = 0x01C0000A


def provision_ecc_ek_cert(tcti: str, issue: Callable[[bytes], bytes]) -> bytes:
    """Write an EK certificate for the TCG L-2 ECC P-256 EK into NV 0x01C0000A.

    ``issue`` gets the EK SubjectPublicKeyInfo DER and returns the certificate DER
    (the tests' own CA issues it; swtpm_setup only makes RSA and P-384 certificates).
    Returns the SPKI DER.
    """
    from tpm2_pytss import ESAPI
    from tpm2_pytss.constants import ESYS_TR, TPM2_ALG, TPMA_NV
    from tpm2_pytss.types import TPM2B_NV_PUBLIC, TPM2B_SENSITIVE_CREATE, TPMS_NV_PUBLIC
    from tpm2_pytss.utils import NVReadEK, create_ek_template

    from protocol import tpm2

    os.environ.setdefault("TSS2_LOG", "all+NONE")
    ctx = ESAPI(tcti)
    try:
        _, template = create_ek_template("EK-ECC256", NVReadEK(ctx))
        handle, pub, _, _, _ = ctx.create_primary(TPM2B_SENSITIVE_CREATE(), template, ESYS_TR.ENDORSEMENT)
        ctx.flush_context(handle)
        spki = tpm2.spki_der(tpm2.parse_public(bytes(pub.publicArea.marshal())))
        cert = issue(spki)
        attrs = TPMA_NV.OWNERWRITE | TPMA_NV.OWNERREAD | TPMA_NV.AUTHREAD | TPMA_NV.AUTHWRITE | TPMA_NV.NO_DA
        nv_public = TPM2B_NV_PUBLIC(
            nvPublic=TPMS_NV_PUBLIC(
                nvIndex=ECC_EK_CERT_INDEX, nameAlg=TPM2_ALG.SHA256, attributes=attrs, dataSize=len(cert)
            )
        )
        nv = ctx.nv_define_space(None, nv_public, ESYS_TR.OWNER)
        for off in range(0, len(cert), 512):
            ctx.nv_write(nv, cert[off : off + 512], off, ESYS_TR.OWNER)
        ctx.tr_close(nv)
        return spki
    finally:
        ctx.close()


def transient_and_session_counts(tcti: str) -> tuple[int, int]:
    """How many transient objects and loaded sessions the TPM holds (for leak tests)."""
    from tpm2_pytss import ESAPI
    from tpm2_pytss.constants import TPM2_CAP, TPM2_HR

    ctx = ESAPI(tcti)
    try:
        _, transient = ctx.get_capability(TPM2_CAP.HANDLES, TPM2_HR.TRANSIENT, 64)
        _, sessions = ctx.get_capability(TPM2_CAP.HANDLES, TPM2_HR.HMAC_SESSION, 64)
        _, policy = ctx.get_capability(TPM2_CAP.HANDLES, TPM2_HR.POLICY_SESSION, 64)
        return len(transient.data.handles), len(sessions.data.handles) + len(policy.data.handles)
    finally:
        ctx.close()
