"""The ``devid`` section of the server configuration: the DevID CA, LDevID enrolment, tpm_devid trust.

Every key is optional; with no section at all nodeserver keeps a DevID CA in ``data_dir``, enrols
LDevIDs for EK-attested agents, and admits ``tpm_devid`` agents whose DevID chains to that CA.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from protocol.settings import Ctx, Setting, Table
from protocol.settings import boolean as _boolean
from protocol.settings import duration as _duration
from protocol.settings import list_of as _list_of
from protocol.settings import path as _path
from protocol.value_kinds import Kind, section

SECTION = "devid"


@dataclass(frozen=True)
class DevidSettings:
    enrol: bool = True  # serve nodetrust.devid.v1.DevId/Enrol on the agent port
    require_join: bool = True  # enrol only machines this server has admitted by a join
    certificate_ttl: dt.timedelta = dt.timedelta(days=365)  # the LDevID certificates' lifetime
    ca_ttl: dt.timedelta = dt.timedelta(days=10 * 365)  # the DevID CA created at first start
    trust_own_ca: bool = True  # tpm_devid admits DevIDs issued by this server's DevID CA
    trusted_ca_files: tuple[Path, ...] = ()  # more DevID trust anchors (a manufacturer's IDevID CA)


_D: dict[str, Any] = {f.name: f.default for f in fields(DevidSettings)}


def _row(name: str, kind: Kind, help_text: str) -> Setting:
    return Setting(name, kind, help_text, _D[name], flag=None)


TABLE = Table(
    SECTION,
    (
        _row("enrol", _boolean(), "issue LDevIDs to EK-attested agents (DevId/Enrol on the listen port)"),
        _row(
            "require_join",
            _boolean(),
            "issue an LDevID only to a machine this server admitted by a join (its pool's checks and measured boot)",
        ),
        _row("certificate_ttl", _duration("1h"), "lifetime of each LDevID certificate"),
        _row("ca_ttl", _duration("1h"), "lifetime of the DevID CA created at first start in data_dir"),
        _row("trust_own_ca", _boolean(), "tpm_devid admits DevIDs that this server's DevID CA issued"),
        _row(
            "trusted_ca_files",
            _list_of(_path(), "a list of PEM files"),
            "more DevID trust anchors for tpm_devid (PEM; e.g. a manufacturer's IDevID CA)",
        ),
    ),
    flags=False,
)


def _build(values: dict[str, Any], ctx: Ctx) -> DevidSettings:
    values = {k: v for k, v in values.items() if v is not None}
    if "trusted_ca_files" in values:
        values["trusted_ca_files"] = tuple(values["trusted_ca_files"])
    return DevidSettings(**values)


KIND = section(TABLE, _build)
