"""The README and docs/ against the tree: links and anchors resolve, every module is on the
package map of docs/architecture.md, every module path the docs name exists, and the README
stays an entry page (docs/check_docs.py does the first three)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_docs_links_package_map_and_paths() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "docs" / "check_docs.py")],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_readme_is_an_entry_page() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    words = len(re.findall(r"\S+", text))
    assert words <= 1500, f"README.md has {words} words; the reference belongs in docs/"
    for command in ("scripts/demo.sh", "scripts/test.sh"):
        assert command in text
    assert not re.search(r"\bissue \d+", text, re.I), "internal issue numbers in README.md"
