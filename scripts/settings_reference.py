"""MkDocs hook: the settings page's table of M2PO's own settings, generated from
`m2po_rllib/config/algorithm_config.py` at build time, so the page cannot drift from the code.

A setting is M2PO's own when `M2POConfig.training()`, `env_runners()` or `evaluation()` takes
it by name; its default is what `M2POConfig()` holds, and its meaning the comment block above
its assignment in `M2POConfig.__init__` (settings assigned one after another share it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

MARKER = "<!-- settings-reference: generated from m2po_rllib/config/algorithm_config.py -->"
CONFIG = Path(__file__).resolve().parents[1] / "m2po_rllib" / "config" / "algorithm_config.py"
METHODS = ("training", "env_runners", "evaluation")
ASSIGNMENT = re.compile(r"^\s*self\.\w+ = ")


def own_settings(tree: ast.Module) -> dict[str, list[str]]:
    """Each config method's own keyword arguments, in order."""
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "M2POConfig")
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    return {m: [a.arg for a in methods[m].args.kwonlyargs] for m in METHODS}


def meanings(source: str, tree: ast.Module) -> dict[str, str]:
    """setting -> the comment block above its assignment in `__init__` (over the assignments
    directly above it, which share the block)."""
    lines = source.splitlines()
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "M2POConfig")
    init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    out = {}
    for node in ast.walk(init):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute)):
            continue
        i = node.lineno - 2  # the line above, 0-based
        while i >= 0 and ASSIGNMENT.match(lines[i]):
            i -= 1
        block = []
        while i >= 0 and lines[i].strip().startswith("#") and not lines[i].strip().startswith("# --"):
            block.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        out[node.targets[0].attr] = " ".join(block)
    return out


def _default(value) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return f"`{text}`" if text not in ("None", "True", "False") else text


def table() -> str:
    from m2po_rllib.config import M2POConfig

    source = CONFIG.read_text()
    tree = ast.parse(source)
    said = meanings(source, tree)
    defaults = M2POConfig()
    rows = ["| method | setting | default | meaning |", "|---|---|---|---|"]
    for method, names in own_settings(tree).items():
        groups: list[tuple[list[str], str]] = []  # settings in signature order, one row per shared comment
        for name in names:
            meaning = said.get(name, "")
            if not meaning:
                raise ValueError(f"m2po_rllib/config/algorithm_config.py: `{name}` has no comment above its assignment in __init__")
            if groups and groups[-1][1] == meaning:
                groups[-1][0].append(name)
            else:
                groups.append(([name], meaning))
        for k, (group, meaning) in enumerate(groups):
            settings = ", ".join(f"`{n}`" for n in group)
            default = ", ".join(_default(getattr(defaults, n)) for n in group)
            rows.append(f"| {f'`{method}`' if k == 0 else ''} | {settings} | {default} | {meaning.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, table())
