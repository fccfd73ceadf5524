"""KUBEADM TEST DOUBLE: an executable named ``kubeadm`` that checks ``join --config FILE`` as kubeadm would.

kubeadm cannot run on the development machines (it needs root, a kubelet and a
cluster), so the agent's join step runs this double instead, through the same
chokepoint (``agent.proc.run``) and the same argv. Contract:

* argv: ``join --config FILE`` or ``join --config=FILE``, optionally ``--v=N``;
  anything else next to ``--config`` is refused as kubeadm refuses it
  ("can not mix '--config' with arguments ...");
* FILE must exist and have mode 0600 (it holds the token; real kubeadm does not check
  this, the double does because the agent promises it);
* FILE must be one YAML document that validates against
  ``kubeadm-joinconfiguration-v1beta4.schema.json``: apiVersion/kind, known fields only at
  every level, types, token format, ``apiServerEndpoint`` HOST:PORT, CA pinning required
  unless ``unsafeSkipCAVerification: true``, exactly one discovery method, taints as a list
  with known effects, ``kubeletExtraArgs`` as a list of ``{name, value}``, durations as Go
  durations, a DNS-1123 node name, a ``unix://`` CRI socket;
* every call is appended to the record file as one JSON line:
  ``{"argv", "config" (tokens redacted to <id>.<redacted>), "mode" ("0600"), "valid",
  "errors", "exit_code"}``;
* exit status: 1 with kubeadm-style errors on stderr for an invalid call; otherwise the
  configured ``exit_code`` (0: kubeadm's success output; non-zero: ``stderr`` or a
  kubeadm-like "JWS signature" error). ``echo_token=True`` prints the full token in the
  output, as a verbose kubeadm might, to prove the agent redacts it; ``sleep_s`` makes it
  hang first (timeouts).

Install with :func:`install_kubeadm_double`; the script runs this module with the
interpreter running the tests.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import time
from pathlib import Path
from typing import Any

SCHEMA = Path(__file__).with_name("kubeadm-joinconfiguration-v1beta4.schema.json")
_REPO = Path(__file__).resolve().parents[2]
_TOKEN = re.compile(r"\b([a-z0-9]{6})\.[a-z0-9]{16}\b")
_SUCCESS = """[preflight] Running pre-flight checks
[preflight] Reading configuration from the "kubeadm-config" ConfigMap in namespace "kube-system"...
[kubelet-start] Writing kubelet configuration to file "/var/lib/kubelet/config.yaml"
[kubelet-start] Writing kubelet environment file with flags to file "/var/lib/kubelet/kubeadm-flags.env"
[kubelet-start] Starting the kubelet
[kubelet-check] Waiting for a healthy kubelet at http://127.0.0.1:10248/healthz. This can take up to 4m0s
[kubelet-start] Waiting for the kubelet to perform the TLS Bootstrap

This node has joined the cluster:
* Certificate signing request was sent to apiserver and a response was received.
* The Kubelet was informed of the new secure connection details.
"""


def install_kubeadm_double(
    bin_dir: Path,
    record: Path,
    *,
    exit_code: int = 0,
    stderr: str | None = None,
    echo_token: bool = False,
    sleep_s: float = 0.0,
) -> Path:
    """Write an executable ``bin_dir/kubeadm``; return its path. Put ``bin_dir`` on PATH to use it by name."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    settings = {
        "record": str(record),
        "exit_code": exit_code,
        "stderr": stderr,
        "echo_token": echo_token,
        "sleep_s": sleep_s,
    }
    script = bin_dir / "kubeadm"
    script.write_text(
        f"#!{sys.executable}\n"
        '"""kubeadm TEST DOUBLE (tests/support/kubeadm_double.py)."""\n'
        "import sys\n"
        f"sys.path.insert(0, {str(_REPO)!r})\n"
        "from tests.support.kubeadm_double import main\n"
        f"sys.exit(main(sys.argv[1:], {json.dumps(settings)!r}))\n"
    )
    script.chmod(0o755)
    return script


def read_record(record: Path) -> list[dict[str, Any]]:
    if not record.exists():
        return []
    return [json.loads(line) for line in record.read_text().splitlines() if line.strip()]


def redact_config(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: redact_config(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_config(v) for v in value]
    if isinstance(value, str):
        return _TOKEN.sub(r"\1.<redacted>", value)
    return value


def _parse_argv(argv: list[str]) -> tuple[str | None, list[str]]:
    """(config path, errors)."""
    if not argv or argv[0] != "join":
        return None, [f"the kubeadm test double only implements 'join', got {argv[:1]}"]
    config, extra = None, []
    args = iter(argv[1:])
    for arg in args:
        if arg == "--config":
            config = next(args, None)
            if config is None:
                return None, ["flag needs an argument: --config"]
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        elif re.fullmatch(r"--?v=\d+", arg):
            continue
        else:
            extra.append(arg.lstrip("-").split("=")[0])
    if config is None:
        return None, ["the kubeadm test double needs --config (the agent always passes one)"]
    if extra:
        return config, [f"can not mix '--config' with arguments {extra}"]
    return config, []


def validate_file(path: Path) -> tuple[Any, str, list[str]]:
    """(parsed document, mode as 4 octal digits, errors) for a join configuration file."""
    import jsonschema
    import yaml

    try:
        st = path.stat()
    except FileNotFoundError:
        return None, "", [f'unable to read config from "{path}" : open {path}: no such file or directory']
    mode = f"{stat.S_IMODE(st.st_mode):04o}"
    errors = []
    if mode != "0600":
        errors.append(f"{path} has mode {mode}; it holds a bootstrap token and must be 0600")
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as exc:
        return None, mode, [*errors, f"error converting YAML to JSON: {exc}"]
    if len(docs) != 1:
        return docs, mode, [*errors, f"expected one JoinConfiguration document, got {len(docs)}"]
    doc = docs[0]
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    for error in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(p) for p in error.absolute_path) or "<root>"
        message = _TOKEN.sub(r"\1.<redacted>", error.message)
        errors.append(f"JoinConfiguration.{where}: Invalid value: {message}")
    return doc, mode, errors


def main(argv: list[str], settings_json: str) -> int:
    settings = json.loads(settings_json)
    if argv[:1] == ["version"]:
        print(
            'kubeadm version: &version.Info{Major:"1", Minor:"31", GitVersion:"v1.31.4-nodetrust-test-double"}'
        )
        return 0
    config, errors = _parse_argv(argv)
    doc, mode = None, ""
    if config is not None and not errors:
        doc, mode, errors = validate_file(Path(config))
    code = 1 if errors else int(settings["exit_code"])
    entry = {
        "argv": argv,
        "config": redact_config(doc),
        "mode": mode,
        "valid": not errors,
        "errors": errors,
        "exit_code": code,
        "cwd": os.getcwd(),
    }
    with open(settings["record"], "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")
    token = ""
    if isinstance(doc, dict):
        token = str(((doc.get("discovery") or {}).get("bootstrapToken") or {}).get("token") or "")
    if settings.get("sleep_s"):
        time.sleep(float(settings["sleep_s"]))  # a hung kubeadm (image pull, kubelet never healthy)
    if errors:
        for error in errors:
            print(f"error execution phase preflight: {error}", file=sys.stderr)
        print("To see the stack trace of this error execute with --v=5 or higher", file=sys.stderr)
        return code
    if settings["echo_token"]:
        print(f"[discovery] Using bootstrap token {token} to fetch cluster-info")
    if code == 0:
        print(_SUCCESS, end="")
        return 0
    message = settings["stderr"] or (
        "error execution phase preflight: couldn't validate the identity of the API Server: could not find a "
        f'JWS signature in the cluster-info ConfigMap for token ID "{token.partition(".")[0]}"'
    )
    if settings["echo_token"]:
        message += f" (token {token})"
    print(message, file=sys.stderr)
    print("To see the stack trace of this error execute with --v=5 or higher", file=sys.stderr)
    return code
