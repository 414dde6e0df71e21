"""The documentation: README stays the front door (short, its links resolve), and the site
(mkdocs.yml over docs/) builds with warnings as errors: a page left out of the nav, a broken
link or a missing image fails here, not on a reader."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_site_builds_strict(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "results" / "index.html").is_file()
    # the generated pages: the settings table from config/algorithm_config.py, the API reference from docstrings
    assert "<code>inflight_weight_updates</code>" in (tmp_path / "site" / "guide" / "settings" / "index.html").read_text()
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert 'id="m2po_rllib.config.algorithm_config.M2POConfig"' in api and 'id="m2po_rllib.wire.batch.row_ages"' in api


def test_every_page_under_docs_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    missing = sorted(p for p in pages if p not in nav)
    assert not missing, f"pages no reader can reach from the site's nav: {missing}"


def test_readme_is_a_front_door_whose_links_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "README holds what it is, the quick start, one example, the headline; the rest goes to docs/"
    assert "RESULTS_PLACEHOLDER" not in readme
    links = [target for target in re.findall(r"\]\(([^)#\s]+)", readme) if "://" not in target]
    assert links, "README links to its documentation"
    broken = [target for target in links if not (REPO / target).exists()]
    assert not broken, f"README links to files that do not exist: {broken}"


def _settings_hook():
    import importlib.util

    spec = importlib.util.spec_from_file_location("settings_reference", REPO / "scripts" / "settings_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_settings_table_is_the_configs_own():
    """Every setting M2POConfig's training / env_runners / evaluation take by name has a row,
    with the default a new config holds; a comment serves the assignments right below it,
    and an assignment after a blank line has none (the build then stops, naming it)."""
    import ast

    from m2po_rllib.config import M2POConfig

    ref = _settings_hook()
    table = ref.table()
    own = [n for names in ref.own_settings(ast.parse(ref.CONFIG.read_text())).values() for n in names]
    assert {"policy_loss", "inflight_weight_updates", "eval_samples"} <= set(own)
    rows = {name: row for row in table.splitlines() for name in own if f"`{name}`" in row.split("|")[2]}
    assert set(rows) == set(own)
    cfg = M2POConfig()
    for name in ("m2_threshold", "max_new_tokens", "weight_sync"):
        assert f"`{getattr(cfg, name)}`" in rows[name].split("|")[3]
    source = "class M2POConfig:\n    def __init__(self):\n        # A.\n        self.a = 1\n        self.b = 2\n\n        self.c = 3\n"
    assert ref.meanings(source, ast.parse(source)) == {"a": "A.", "b": "A.", "c": ""}
