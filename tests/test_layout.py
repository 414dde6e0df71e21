"""The package's layout is its architecture: the algorithm's room never imports the jobs',
the learner never imports the runner side, and no modules import each other in a circle
(imports inside functions count too). Read from the source, no import is run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "m2po_rllib"
# RLlib's pairing (PPOConfig and PPO share ppo.py): the config's default `algo_class` is the
# algorithm, and the algorithm's default config is the config. Two files, one unit.
ALLOWED_CYCLES = [{"m2po_rllib.config.algorithm_config", "m2po_rllib.driver.m2po"}]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("m2po_rllib"):
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("m2po_rllib")]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_import_cycles():
    assert [c for c in _cycles(import_graph()) if c not in ALLOWED_CYCLES] == []


@pytest.mark.parametrize(
    "importer, forbidden",
    [
        ("m2po_rllib.", "m2po_rllib.jobs"),  # the algorithm's room never imports the jobs'
        ("m2po_rllib.torch.", "m2po_rllib.rollout"),  # the learner side never imports the runner side
        ("m2po_rllib.losses", "m2po_rllib.torch"),  # pure torch: no RLlib classes
        ("m2po_rllib.losses", "m2po_rllib.rollout"),
        ("m2po_rllib.sync", "m2po_rllib.rollout"),  # weight sync serves both sides, imports neither
        ("m2po_rllib.sync", "m2po_rllib.torch"),
        ("m2po_rllib.common", "m2po_rllib."),  # the shared vocabulary imports nothing of the package
    ],
)
def test_rooms_import_only_downwards(importer, forbidden):
    graph = import_graph()
    offending = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module.startswith(importer) and not module.startswith("m2po_rllib.jobs")
        for target in targets
        if target.startswith(forbidden)
    )
    assert offending == []


# The root shows the architecture: the driver, the configuration and the shared vocabulary
# each in a folder of its own beside the sides they drive; no module lies loose at the root
# but the package's face and the old names of the modules that moved (for old checkpoints).
ROOM_FOLDERS = {"common", "config", "driver", "jobs", "losses", "models", "rollout", "sync", "torch", "wire"}


def test_the_root_holds_folders_by_side_and_no_loose_modules():
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "moved.py"]
    assert {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} == ROOM_FOLDERS


def test_no_code_imports_a_module_by_its_old_name():
    from m2po_rllib.moved import new_name

    root = PACKAGE.parent
    old = sorted(
        f"{path.relative_to(root)}: {target}"
        for folder in (PACKAGE, root / "tests", root / "bench", root / "scripts", root / "tune", root / "envs")
        for path in folder.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for target in (
            [a.name for a in node.names] if isinstance(node, ast.Import)
            else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        )
        if new_name(target)
    )
    assert old == []


MAX_LINES = 400  # a file that grows past it does more than one job: split it by job


def test_no_source_file_is_over_400_lines():
    root = PACKAGE.parent
    long = sorted(
        f"{path.relative_to(root)}: {n} lines"
        for folder in (PACKAGE, root / "envs")
        for path in folder.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    )
    assert long == []
