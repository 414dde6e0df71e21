"""README against the code it describes, read from the files (nothing is built or run): its
Python example leaves no algorithm running behind a reused name, and the metric keys of its
"Metrics" section exist and are named under the result path where they are recorded."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from m2po_rllib.common import keys

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
GUIDES = "\n".join(p.read_text() for p in sorted((REPO / "docs" / "guide").glob("*.md")))
METRICS = (REPO / "docs" / "guide" / "metrics.md").read_text()
# Result paths a README key may carry (keys.RUNNERS, keys.LEARNER, keys.EVALUATION).
PATHS = tuple("/".join(p) + "/" for p in (keys.EVALUATION, keys.RUNNERS, keys.LEARNER))


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_readme_example_stops_an_algorithm_before_it_builds_another():
    """Rebinding `algo` without `algo.stop()` leaves the first algorithm's EnvRunners and
    engines running next to the second's."""
    blocks = [b for b in _python_blocks(README + GUIDES) if "algo" in b]
    assert blocks, "README and the guides have no Python example that builds an algorithm"
    for block in blocks:
        running = False
        for stmt in ast.parse(block).body:
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "algo" for t in stmt.targets):
                assert not running, f"`algo` is rebound at line {stmt.lineno} while the first one runs:\n{block}"
                running = True
            elif isinstance(stmt, ast.Expr) and ast.unparse(stmt.value) == "algo.stop()":
                running = False


def _named_keys(section: str) -> list[str]:
    """Each metric key the section names in backticks, `a/b_min|mean|max` expanded."""
    named = []
    for token in re.findall(r"`([\w/|<>]+)`", section):
        if "/" not in token or token.endswith("/"):
            continue
        first, *alternatives = token.split("|")
        named.append(first)
        for alt in alternatives:  # replaces the end of the first: `_min|mean` or `changed_frac|ess`
            cuts = [i + 1 for i, c in enumerate(first) if c in "/_"]
            named.append(next((first[:i] + alt for i in reversed(cuts) if _is_key(_strip(first[:i] + alt))),
                              first[:cuts[-1]] + alt))
    return named


def _strip(name: str) -> str:
    return next((name[len(p):] for p in PATHS if name.startswith(p)), name)


def _is_key(name: str) -> bool:
    constants = {v for k, v in vars(keys).items() if k.isupper() and isinstance(v, str)}
    constants |= {f(family) for f in (keys.clipped_frac, keys.entropy_clipped) for family in keys.CLIP_FAMILIES}
    return name in constants or name == keys.m2_at_age(0).replace("0", "<b>")


def _runner_keys() -> set[str]:
    """The keys the EnvRunner logs itself (`self.metrics.log_value(keys.X, ...)`): a result
    holds them under env_runners/."""
    tree = ast.parse((REPO / "m2po_rllib" / "rollout" / "env_runner.py").read_text())
    return {
        getattr(keys, node.args[0].attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "log_value"
        and node.args and isinstance(node.args[0], ast.Attribute)
        and isinstance(node.args[0].value, ast.Name) and node.args[0].value.id == "keys"
    }


def test_every_metric_the_readme_names_is_a_key():
    named = _named_keys(METRICS)
    assert len(named) > 30, named
    assert [n for n in named if not _is_key(_strip(n))] == []


def test_the_readme_names_the_runners_metrics_under_env_runners():
    """A runner's metric is at env_runners/<key> in a result and in TensorBoard: named bare
    (`rollout/behavior_logp_s`) it reads as an algorithm key at the top, where it is not."""
    runner = _runner_keys()
    assert keys.BEHAVIOR_LOGP_S in runner and keys.REWARD_MEAN in runner
    named = _named_keys(METRICS)
    assert any(n.startswith(PATHS[1]) for n in named)
    assert [n for n in named if n in runner] == []
