"""What the report tests share: `m2po report` run in this process, a row of its table, and a
Tune trial's results."""

from __future__ import annotations

import json
from pathlib import Path


def run_report(capsys, *args) -> tuple[int, str, str]:
    """`m2po report ARGS` in this process (the console script's `main`)."""
    from m2po_rllib.jobs.cli import main

    code = main(["report", *args])
    out, err = capsys.readouterr()
    return code, out, err


def table_row(md: str, variant: str) -> list[str]:
    line = next(line for line in md.splitlines() if line.startswith(f"| {variant} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def trial_results(trial_dir: Path) -> list[dict]:
    """A Tune trial's results, one per line of its result.json."""
    return [json.loads(line) for line in (trial_dir / "result.json").read_text().splitlines()]
