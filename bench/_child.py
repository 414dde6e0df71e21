"""The benches' one way to run a variant: in a fresh process of their own script
(`script --child VARIANT ...`), whose last line of output is the run's figures as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_child(script: str, variant: str, iters: int, seed: int, eval_problems: int) -> dict:
    """Runs `script --child variant` (nothing else of the bench in that process); its figures."""
    cmd = [sys.executable, script, "--child", variant, "--iters", str(iters), "--seed", str(seed),
           "--eval-problems", str(eval_problems)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} seed {seed} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def add_child_arguments(parser) -> None:
    """The options `run_child` passes (hidden from --help): one owner for both sides."""
    import argparse

    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--eval-problems", type=int, default=0, help=argparse.SUPPRESS)


def answer_child(args, child) -> bool:
    """In a child process (`--child VARIANT`): runs `child(variant, iters, seed, eval_problems)`,
    prints its figures as the last line and returns True; else False."""
    if not args.child:
        return False
    print(json.dumps(child(args.child, args.iters, args.seed, args.eval_problems)))
    return True
