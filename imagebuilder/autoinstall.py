"""The autoinstall user-data and NoCloud meta-data, rendered from the templates in ``cloud-init/``.

The canonical templates are ``cloud-init/autoinstall-user-data.yaml.tmpl``,
``cloud-init/stage.sh`` and ``cloud-init/provision-init.sh`` at the repository root; ``imagebuilder/templates/`` holds
identical copies (package data) used when the builder runs from an installed package.
A test keeps the two in step.

``{{ name }}`` placeholders are replaced by JSON values; a key whose value renders to
null is dropped, so optional sections (the webhook without a network, the source id)
disappear instead of becoming ``null``.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from imagebuilder.definition import Definition
from imagebuilder.errors import BuildError

USER_DATA_TEMPLATE = "autoinstall-user-data.yaml.tmpl"
STAGE_SCRIPT = "stage.sh"
PROVISION_INIT = "provision-init.sh"
# package data names (setuptools ships *.tmpl)
_PACKAGED = {
    USER_DATA_TEMPLATE: USER_DATA_TEMPLATE,
    STAGE_SCRIPT: "stage.sh.tmpl",
    PROVISION_INIT: "provision-init.sh.tmpl",
}
CANONICAL_DIR = Path(__file__).resolve().parent.parent / "cloud-init"
DATA_PORT = "/dev/ttyS1"
GUEST_LISTENER = "10.0.2.100:8080"
_PLACEHOLDER = re.compile(r"\{\{\s*([a-z_]+)\s*\}\}")


def template_text(name: str) -> str:
    """A template from ``cloud-init/`` when running from the repository, else the packaged copy."""
    canonical = CANONICAL_DIR / name
    if canonical.is_file():
        return canonical.read_text(encoding="utf-8")
    return resources.files("imagebuilder.templates").joinpath(_PACKAGED[name]).read_text(encoding="utf-8")


def render(template: str, values: dict[str, Any]) -> str:
    """Replace ``{{ name }}`` with ``json.dumps(values[name])``; unknown or unused names are errors."""
    used: set[str] = set()

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise BuildError(f"template placeholder {{{{ {name} }}}} has no value")
        used.add(name)
        return json.dumps(values[name])

    text = _PLACEHOLDER.sub(replace, template)
    unused = set(values) - used
    if unused:
        raise BuildError(f"template has no placeholder for: {', '.join(sorted(unused))}")
    return text


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


#: What every webhook URL of a build starts with (after ``http://``): a file of the image holding it holds a token.
WEBHOOK_PREFIX = f"{GUEST_LISTENER}/nodetrust/"


def webhook_url(token: str) -> str:
    return f"http://{WEBHOOK_PREFIX}{token}/events"


def user_data(defn: Definition, *, webhook: str | None, data_port: str = DATA_PORT) -> str:
    """The ``#cloud-config`` with the ``autoinstall:`` section for this definition.

    ``data_port`` is the guest device of the builder's data port (``/dev/ttyS1`` on amd64,
    the virtio console ``/dev/hvc0`` on arm64, see :mod:`imagebuilder.domain`)."""
    values: dict[str, Any] = {
        "source": {"id": defn.installer.source_id} if defn.installer.source_id else None,
        "ssh_install_server": defn.ssh.install_server,
        "ssh_allow_pw": defn.ssh.allow_password,
        # The installer needs identity or user-data; the image's user is created by the staging step
        # and the target's cloud-init is cleaned for the node's own first boot.
        "user_data": {"disable_root": True},
        "webhook": {"type": "webhook", "endpoint": webhook, "level": "DEBUG"} if webhook else None,
        "data_port": data_port,
    }
    rendered = render(template_text(USER_DATA_TEMPLATE), values)
    if not rendered.startswith("#cloud-config\n"):
        raise BuildError(
            f"{USER_DATA_TEMPLATE} must start with #cloud-config (else the installer goes interactive)"
        )
    try:
        data = yaml.safe_load(rendered)
    except yaml.YAMLError as exc:
        raise BuildError(f"{USER_DATA_TEMPLATE} renders to invalid YAML: {exc}") from exc
    check(data)
    return "#cloud-config\n" + yaml.safe_dump(_drop_nulls(data), sort_keys=False, width=4096)


def check(data: object) -> None:
    """What the builder relies on: autoinstall v1, power-off, late- and error-commands, no questions."""
    if not isinstance(data, dict) or not isinstance(data.get("autoinstall"), dict):
        raise BuildError("the user-data has no top-level autoinstall: mapping")
    auto = data["autoinstall"]
    problems = []
    if auto.get("version") != 1:
        problems.append("version must be 1")
    if auto.get("shutdown") != "poweroff":
        problems.append("shutdown must be poweroff (the builder waits for the VM to power off)")
    if auto.get("interactive-sections"):
        problems.append("interactive-sections must be empty (it also disables reporting)")
    if not auto.get("late-commands") or not auto.get("error-commands"):
        problems.append("late-commands and error-commands are required")
    if problems:
        raise BuildError("the autoinstall template is unusable: " + "; ".join(problems))


def meta_data(build_id: str) -> str:
    return f"instance-id: {build_id}\nlocal-hostname: {build_id[:63]}\n"
