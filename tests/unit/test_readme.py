"""The README stays a true front door: its file tree names what the repository holds, it stays
short, and its links into docs/ lead somewhere.

The tree is the fenced block under "## Files": a line at the left margin names a top-level file
or folder, a line indented by two spaces a package of ``server/``. Every named path must exist;
every top-level entry git tracks and every package of ``server/`` must be named.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.support import ROOT

README = ROOT / "README.md"
MAX_LINES = 300


def _tree() -> tuple[list[str], list[str]]:
    """The README's tree: (top-level names, server/ package names), trailing slashes removed."""
    text = README.read_text()
    section = text.split("\n## Files\n", 1)
    assert len(section) == 2, 'the README has no "## Files" section'
    block = re.search(r"```\n(.*?)\n```", section[1], re.S)
    assert block, 'the "## Files" section has no fenced tree'
    top, server = [], []
    for line in block.group(1).splitlines():
        name = line.split(maxsplit=1)[0].rstrip("/") if line.strip() else ""
        if not name:
            continue
        if not line.startswith(" "):
            top.append(name)
        elif line.startswith("  ") and not line.startswith("   "):
            server.append(name)
    return top, server


def _tracked_top_level() -> set[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    ).stdout.decode()
    return {path.split("/", 1)[0] for path in out.split("\0") if path}


def test_every_path_in_the_tree_exists():
    top, server = _tree()
    missing = [name for name in top if not (ROOT / name).exists()]
    missing += [f"server/{name}" for name in server if not (ROOT / "server" / name).exists()]
    assert not missing, f"the README's tree names paths that do not exist: {missing}"


def test_the_tree_names_every_tracked_top_level_entry():
    top, _ = _tree()
    unnamed = sorted(_tracked_top_level() - set(top))
    assert not unnamed, f"tracked top-level entries missing from the README's tree: {unnamed}"


def test_the_tree_names_every_server_package():
    _, server = _tree()
    packages = {p.parent.name for p in (ROOT / "server").glob("*/__init__.py")}
    unnamed = sorted(packages - set(server))
    assert not unnamed, f"server/ packages missing from the README's tree: {unnamed}"


def test_the_readme_stays_short():
    lines = README.read_text().count("\n")
    assert lines < MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_the_readme_starts_with_the_two_commands():
    head = README.read_text().splitlines()[:6]
    assert any(line.startswith("make demo ") for line in head)
    assert any(line.startswith("make test ") for line in head)


def test_links_into_docs_resolve():
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]*))?\)", README.read_text())
    assert links, "the README links into docs/"
    broken = [path for path, _ in links if not (ROOT / path).is_file()]
    assert not broken, f"README links to missing docs pages: {broken}"
    for path, anchor in links:
        if anchor:
            assert anchor in _anchors((ROOT / path).read_text()), f"{path} has no #{anchor}"


def _anchors(page: str) -> set[str]:
    """A page's heading ids as the site's toc makes them: an explicit ``{#id}``, else the heading
    lowercased, punctuation dropped, spaces as hyphens."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", page, re.M):
        explicit = re.search(r"\{#([\w-]+)\}\s*$", heading)
        if explicit:
            anchors.add(explicit.group(1))
        else:
            slug = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
            anchors.add(re.sub(r"[\s-]+", "-", slug))
    return anchors
