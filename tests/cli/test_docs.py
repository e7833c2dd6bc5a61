"""The guides exist, and the connector reference lists every metric the connector defines.

The metric names are read from the source of every ``stats.py`` under
``kvstage/integrations/vllm`` (importing one needs vLLM): each literal
``name="vllm:kvstage_..."`` (an ``{d}`` expanded to both copy directions) and each key of a
``METRICS`` table (``vllm:kvstage_<key>``) must appear in docs/connector.md (a counter is
documented with the ``_total`` suffix Prometheus adds). The settings are held by
tests/integrations/test_vllm_config.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDES = ("deploy.md", "connector.md", "architecture.md", "library.md")


def metric_names(source: str) -> set[str]:
    names: set[str] = set()
    for name in re.findall(r'name=f?"(vllm:kvstage_[a-z_{}]+)"', source):
        if "{name}" not in name:
            names.update(name.replace("{d}", d) for d in ("d2h", "h2d"))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign):
            target, value = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "METRICS" and isinstance(value, ast.Dict):
            names.update(f"vllm:kvstage_{k.value}" for k in value.keys
                         if isinstance(k, ast.Constant))
    return names


def test_the_four_guides_exist_and_the_readme_links_them() -> None:
    readme = (ROOT / "README.md").read_text()
    for guide in GUIDES:
        assert (ROOT / "docs" / guide).is_file(), guide
        assert f"(docs/{guide})" in readme, f"README does not link docs/{guide}"


def test_every_connector_metric_is_in_the_reference() -> None:
    names: set[str] = set()
    for path in (ROOT / "src/kvstage/integrations/vllm").rglob("stats.py"):
        names |= metric_names(path.read_text())
    assert "vllm:kvstage_h2d_bytes" in names and len(names) >= 8, names
    doc = (ROOT / "docs" / "connector.md").read_text()
    missing = sorted(n for n in names if f"`{n}" not in doc)
    assert not missing, f"docs/connector.md lacks the metrics {missing}"


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_relative_link_resolves() -> None:
    docs = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "RELIABILITY.md",
            *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, frag = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.name}: {target}")
            elif frag and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", dest.read_text(), re.MULTILINE)
                if frag not in {anchor(h) for h in headings}:
                    broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, broken
