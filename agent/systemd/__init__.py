"""systemd files shipped with the agent (package data), installed into the image by the builder.

``nodeagent.service``                 -> /usr/lib/systemd/system/nodeagent.service (enabled)
``kubelet.service.d/10-nodeagent.conf`` -> /usr/lib/systemd/system/kubelet.service.d/10-nodeagent.conf
``nodeagent-reattest.service``       -> /usr/lib/systemd/system/nodeagent-reattest.service
``nodeagent-reattest.timer``         -> /usr/lib/systemd/system/nodeagent-reattest.timer (enabled)

Packaged units belong in ``/usr/lib/systemd/system``, the vendor layer; ``/etc/systemd/system``
is the administrator's, whose files and drop-ins override these.

Public API::

    FILES: dict[str, str]        # file name here -> installed path
    read(name: str) -> str       # the text of one of FILES

See docs/systemd.md for what each directive is for.
"""

from __future__ import annotations

from importlib import resources

FILES = {
    "nodeagent.service": "/usr/lib/systemd/system/nodeagent.service",
    "kubelet.service.d/10-nodeagent.conf": "/usr/lib/systemd/system/kubelet.service.d/10-nodeagent.conf",
    "nodeagent-reattest.service": "/usr/lib/systemd/system/nodeagent-reattest.service",
    "nodeagent-reattest.timer": "/usr/lib/systemd/system/nodeagent-reattest.timer",
}


def read(name: str) -> str:
    if name not in FILES:
        raise KeyError(f"not a shipped systemd file: {name!r} (known: {', '.join(FILES)})")
    node = resources.files(__name__)
    for part in name.split("/"):
        node = node / part
    return node.read_text(encoding="utf-8")
