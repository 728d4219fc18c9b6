"""The Markdown a user navigates: every relative link (and #anchor) resolves, and the extras the
documents name are the extras pyproject.toml defines."""
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "node_modules", ".pytest_cache"}
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.md")
                  if not SKIP_DIRS & set(p.relative_to(ROOT).parts))


def _prose(text: str) -> str:
    """``text`` without fenced blocks and inline code (links there are not links)."""
    return CODE.sub("", FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to
    '-', a repeated heading suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    text = _prose(path.read_text())
    bad = []
    for target in LINK.findall(text) + REF.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target} (no {dest.relative_to(ROOT) if ROOT in dest.parents else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    return bad


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_the_link_check_can_fail(tmp_path):
    (tmp_path / "b.md").write_text("# Real heading\n\ntext\n")
    a = tmp_path / "a.md"
    a.write_text("[ok](b.md) [ok](b.md#real-heading) [gone](c.md) [no anchor](b.md#other)\n"
                 "`[in code](d.md)`\n```\n[in a block](e.md)\n```\n[web](https://x.org/y)\n")
    assert broken_links(a) == ["c.md (no " + str((tmp_path / "c.md").resolve()) + ")",
                               "b.md#other (no heading #other in b.md)"]


def test_anchors_follow_github():
    assert "text-lengths-and-torchcompile" in anchors(ROOT / "docs" / "features.md")
    assert "devices-local_rank" in anchors(ROOT / "docs" / "cluster.md")


# ---------------------------------------------------------------- extras

def defined_extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def named_extras(text: str) -> set[str]:
    """Extras in install commands: ``xfuser-swiftfusion[a,b]``, ``.[a,b]``, and ``[a]`` in
    backticks (how the documents name an extra)."""
    found = set()
    for m in re.finditer(r"(?:xfuser-swiftfusion|(?<![\w.])\.|`)\[([a-z0-9_,\s-]+)\]", text):
        found |= {e.strip() for e in m.group(1).split(",") if e.strip()}
    return found


def test_documents_name_only_defined_extras():
    extras = defined_extras()
    for path in markdown_files():
        unknown = named_extras(path.read_text()) - extras
        assert not unknown, f"{path.relative_to(ROOT)} names extras {unknown}; pyproject has {extras}"


def test_every_extra_is_documented():
    """The install guide's table has a row per extra; the front page names the GPU ones."""
    install = (ROOT / "docs" / "install.md").read_text()
    rows = set(re.findall(r"^\| `([a-z0-9_-]+)` \|", install, re.M))
    assert rows == defined_extras()
    readme = named_extras((ROOT / "README.md").read_text())
    assert {"cu12", "cu13", "tools", "test", "gpu"} <= readme


def test_extras_check_can_fail():
    assert named_extras('pip install ".[cu13,tools]" and `[gpu]`') == {"cu13", "tools", "gpu"}
    assert named_extras("pip install xfuser-swiftfusion[cuda]") - defined_extras() == {"cuda"}
    assert named_extras("test_x...[raise] and a.[b]") == set()  # pytest ids, attribute access
