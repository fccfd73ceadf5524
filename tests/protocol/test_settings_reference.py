"""docs/settings.md and the JSON Schemas beside it are what the settings tables generate (`make settings`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gensettings  # noqa: E402

from agent.config import SETTINGS  # noqa: E402
from server.config import TABLE  # noqa: E402


def test_the_committed_reference_is_current() -> None:
    assert gensettings.stale() == [], "run `make settings` and commit the result"


def test_stale_files_are_noticed(tmp_path: Path) -> None:
    for path, text in gensettings.render().items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert gensettings.stale(tmp_path) == []
    doc = tmp_path / gensettings.DOC
    doc.write_text(doc.read_text().replace("| `deadline_s` |", "| `deadline` |"))
    assert gensettings.stale(tmp_path) == [str(gensettings.DOC)]


def test_the_reference_lists_every_setting_with_its_sources() -> None:
    text = (ROOT / gensettings.DOC).read_text()
    for s in SETTINGS:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{s.key}` |"))
        for where in (s.flag, s.env, f"{s.cmdline}="):
            assert f"`{where}`" in row, (s.key, where)
    for s in TABLE.settings:
        assert f"| `{s.key}` |" in text
    schema = json.loads((ROOT / gensettings.SCHEMAS["nodeserver"]).read_text())
    assert set(schema["properties"]) == {s.key for s in TABLE.settings}
