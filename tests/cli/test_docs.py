"""The guides exist, and the connector reference lists every metric the connector defines.

The metric names are read from ``kvstage/integrations/vllm/stats.py``'s source (importing it
needs vLLM): each ``name="vllm:kvstage_..."`` there, an ``{d}`` expanded to both copy
directions, must appear in docs/connector.md (a counter is documented with the ``_total``
suffix Prometheus adds). The settings are held by tests/integrations/test_vllm_config.py.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDES = ("deploy.md", "connector.md", "architecture.md", "library.md")


def metric_names(source: str) -> set[str]:
    names: set[str] = set()
    for name in re.findall(r'name=f?"(vllm:kvstage_[a-z_{}]+)"', source):
        for d in ("d2h", "h2d"):
            names.add(name.replace("{d}", d))
    return names


def test_the_four_guides_exist_and_the_readme_links_them() -> None:
    readme = (ROOT / "README.md").read_text()
    for guide in GUIDES:
        assert (ROOT / "docs" / guide).is_file(), guide
        assert f"(docs/{guide})" in readme, f"README does not link docs/{guide}"


def test_every_connector_metric_is_in_the_reference() -> None:
    source = (ROOT / "src/kvstage/integrations/vllm/stats.py").read_text()
    names = metric_names(source)
    assert "vllm:kvstage_h2d_bytes" in names and len(names) >= 8, names
    doc = (ROOT / "docs" / "connector.md").read_text()
    missing = sorted(n for n in names if f"`{n}" not in doc)
    assert not missing, f"docs/connector.md lacks the metrics {missing}"
