"""Check the docs against the tree: ``python docs/check_docs.py`` (exit 1 on any problem).

- every relative link in README.md and docs/*.md names an existing file, and an ``#anchor``
  into a Markdown file names one of its headings (GitHub's slugs);
- every module under mergefs/ is named in docs/architecture.md's package map;
- every ``mergefs/...`` path and ``mergefs.x.y`` module named in the docs exists.

Standard library only; reads files, writes nothing.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
PATH = re.compile(r"(?<![\w./-])mergefs/[A-Za-z0-9_/]+(?:\.py)?")
DOTTED = re.compile(r"(?<![\w./-])mergefs(?:\.[a-z_][a-z0-9_]*)+")


def slug(heading: str) -> str:
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = CODE_BLOCK.sub("", md.read_text(encoding="utf-8"))
    return {slug(h) for h in HEADING.findall(text)}


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def check_links(problems: list[str]) -> None:
    for md in docs():
        text = CODE_BLOCK.sub("", md.read_text(encoding="utf-8"))
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, frag = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            where = f"{md.relative_to(ROOT)}: {target}"
            if not dest.exists():
                problems.append(f"{where}: no such file")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                problems.append(f"{where}: no heading #{frag} in {dest.relative_to(ROOT)}")


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted((ROOT / "mergefs").rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts)] = p
    return out


def check_map(problems: list[str]) -> None:
    """Each module of a package is named (as `module`) in that package's part of the map, which
    starts at a line like **`core/`**; modules at the top (`ops.py`) are named with `.py`."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    parts = re.split(r"^\*\*`([a-z_]+)/`\*\*", text, flags=re.M)
    sections = {parts[k]: parts[k + 1] for k in range(1, len(parts) - 1, 2)}
    for name, path in modules().items():
        pkg = name.split(".")[1:]
        if len(pkg) == 1:  # mergefs/ops.py, mergefs/__init__.py
            ok = f"`{path.name}`" in text or f"`mergefs/{path.name}`" in text
        elif pkg[-1] == "__init__":
            ok = pkg[0] in sections
        else:
            ok = bool(re.search(rf"`{pkg[-1]}`", sections.get(pkg[0], "")))
        if not ok:
            problems.append(f"docs/architecture.md: {path.relative_to(ROOT)} is not in the "
                            "package map")


def check_paths(problems: list[str]) -> None:
    mods = modules()
    for md in docs():
        text = md.read_text(encoding="utf-8")
        for m in sorted(set(PATH.findall(text))):
            rel = m.rstrip("/")
            if not (ROOT / rel).exists() and not (ROOT / (rel + ".py")).exists():
                problems.append(f"{md.relative_to(ROOT)}: {m} does not exist")
        for m in sorted(set(DOTTED.findall(text))):
            parts = m.split(".")
            # mergefs.open, mergefs.core.errors.MergefsError: the longest module prefix must
            # exist, and at most one name (a class, a function) may follow it
            for k in range(len(parts), 0, -1):
                name = ".".join(parts[:k])
                if name in mods or f"{name}.__init__" in mods:
                    break
            else:
                k = 0
            if k == 0 or len(parts) - k > 1:
                problems.append(f"{md.relative_to(ROOT)}: {m} is not a mergefs module (or a "
                                "name in one)")


def main() -> int:
    problems: list[str] = []
    check_links(problems)
    check_map(problems)
    check_paths(problems)
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s)" if problems else "docs: links, package map and module "
          "paths OK")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
