"""Superseded by the staleness lab; kept as a thin wrapper around `m2po lab`.

    python tune/threshold_staleness.py --space tune/spaces/cpu.yaml [--out DIR] [--max-concurrent N]

The search spaces (loss x staleness x tau x lr x seeds) are the YAML files in tune/spaces/;
see `m2po lab --help` and m2po_rllib/jobs/lab.py.
"""

from __future__ import annotations

import sys

from m2po_rllib.jobs.cli import main

if __name__ == "__main__":
    sys.exit(main(["lab", *sys.argv[1:]]))
