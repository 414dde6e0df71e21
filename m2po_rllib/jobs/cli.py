"""The `m2po` command line: train, eval, export, lab, report.

    m2po train [--config configs/default.yaml] [--stop-iters N] [--output DIR] [section.key=value ...]
    m2po train --resume DIR [run.key=value | training.lr=... (see run_dir.RESUME_SAFE)]
    m2po eval  --checkpoint DIR | --model builtin:arith-tiny  [--split heldout] [--samples k]
    m2po export --checkpoint DIR --out HF_DIR
    m2po plan  --config configs/paper_qwen3_1.7b_stale256.yaml [--gpu-memory-gb 80] [--gpus 16]
    m2po lab    [--space tune/spaces/cpu.yaml] [--out DIR] [--max-concurrent N] [--dry-run]
    m2po report DIR [DIR ...] [--out OUT] [--last-k K] [--margin M]
"""

from __future__ import annotations

import argparse
import os
import sys

from m2po_rllib.common.errors import ConfigError
from m2po_rllib.jobs.run_dir import DEFAULT_CONFIG, default_config_path

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="m2po", description="M2PO on Ray RLlib: train and evaluate LLMs on stale rollouts."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("train", help="train with a YAML config (the main job)")
    p.add_argument("--config", default=None, help=f"YAML config (default: {DEFAULT_CONFIG})")
    p.add_argument("--stop-iters", type=int, default=None, help="training iterations (default: the config's)")
    p.add_argument("--stop-minutes", type=float, default=None, help="stop after this wall-clock time")
    p.add_argument("--output", default=None, help="run directory (default: runs/<config>-<time>)")
    p.add_argument(
        "--resume", default=None,
        help="continue the run in this directory; overrides may change run.*, training.lr and a few others",
    )
    p.add_argument("--checkpoint-every", type=int, default=None, help="iterations between checkpoints")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. training.lr=1e-5")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("eval", help="held-out accuracy of a checkpoint or a model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a run directory or checkpoint directory")
    src.add_argument("--model", help="a HF model directory or builtin name")
    p.add_argument("--config", default=None, help=f"YAML config for the env (default: the run's, or {DEFAULT_CONFIG})")
    p.add_argument("--split", default="heldout", choices=["heldout", "train"])
    p.add_argument("--num", type=int, default=None, help="problems (default: the config's evaluation_duration)")
    p.add_argument("--samples", type=int, default=1, help="k for mean@k (sampled at the config's temperature)")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("export", help="write a checkpoint's policy as a Hugging Face model directory")
    p.add_argument("--checkpoint", required=True, help="a run directory or checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (loadable by transformers and vLLM)")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("plan", help="dry run: Ray resources, parameter count, learner memory (no weights loaded)")
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/paper_qwen3_1.7b_stale256.yaml")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one learner GPU in GiB (default 80)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs of the node or cluster to plan for (default: this machine's)")
    p.add_argument("--prompt-len", type=int, default=None, help="longest prompt (default: max_model_len - max_new_tokens)")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. training.micro_batch_size=4")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("lab", help="the staleness lab: a Ray Tune search from a space file, then its report")
    p.add_argument("--space", default="tune/spaces/cpu.yaml", help="search space (default: tune/spaces/cpu.yaml)")
    p.add_argument("--out", default=None, help="experiment directory (default: runs/lab/<name>-<time>)")
    p.add_argument("--max-concurrent", type=int, default=None, help="trials at a time (default: what fits)")
    p.add_argument("--dry-run", action="store_true", help="validate every trial and print the plan; run nothing")
    p.add_argument("--no-report", action="store_true", help="skip the report at the end")
    p.add_argument("--stop", action="append", metavar="KEY=VALUE",
                   help="replace the space's stop rule, e.g. --stop policy_version=40 for a quick try")
    p.add_argument("overrides", nargs="*", help="section.key=value for every trial")
    p.set_defaults(func=_cmd_lab)

    p = sub.add_parser("report", help="table and plots over run directories or a Tune experiment")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="`m2po train` run dirs or a `m2po lab` experiment")
    p.add_argument("--out", default=None, help="output directory (default: the first DIR/report)")
    from m2po_rllib.jobs.claims import MARGIN
    from m2po_rllib.jobs.runs import LAST_K

    p.add_argument("--last-k", type=int, default=LAST_K, metavar="K",
                   help=f"a run's final value: the mean of its last K held-out evaluations (default {LAST_K})")
    p.add_argument("--margin", type=float, default=MARGIN,
                   help=f"the claims' equivalence margin in accuracy (default {MARGIN:g})")
    p.set_defaults(func=_cmd_report)
    return parser


def _cmd_train(args) -> int:
    if not os.environ.get("RAY_ADDRESS"):
        # The local Ray this job starts: token authentication, as Ray does by default, but
        # asked for explicitly, so Ray does not warn that it chose it. Set before Ray is
        # imported (it reads the mode once). A cluster's (RAY_ADDRESS) own settings rule.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    from m2po_rllib.jobs.train import run_training

    return run_training(
        config_path=args.config or (None if args.resume else default_config_path()),
        overrides=args.overrides,
        stop_iters=args.stop_iters,
        stop_minutes=args.stop_minutes,
        output=args.output,
        resume=args.resume,
        checkpoint_every=args.checkpoint_every,
        progress=not args.no_progress,
    )


def _cmd_eval(args) -> int:
    from m2po_rllib.jobs.train import run_eval

    return run_eval(
        checkpoint=args.checkpoint,
        model=args.model,
        config_path=args.config,
        overrides=args.overrides,
        split=args.split,
        num=args.num,
        samples=args.samples,
    )


def _cmd_export(args) -> int:
    from m2po_rllib.jobs.export import export_checkpoint

    path = export_checkpoint(args.checkpoint, args.out)
    print(f"wrote a Hugging Face model to {path}")
    return 0


def _cmd_plan(args) -> int:
    from m2po_rllib.jobs.plan import run_plan

    if args.gpus is not None and args.gpus < 0:
        raise ConfigError(f"--gpus ({args.gpus}) must be >= 0: the GPUs of the node to plan for")
    return run_plan(args.config, args.gpu_memory_gb, overrides=args.overrides, prompt_len=args.prompt_len, gpus=args.gpus)


def _cmd_lab(args) -> int:
    from m2po_rllib.jobs.lab import dry_run, run_lab

    if args.dry_run:
        return dry_run(args.space, overrides=args.overrides, stop=args.stop)
    return run_lab(
        args.space, out=args.out, max_concurrent=args.max_concurrent, overrides=args.overrides, stop=args.stop,
        report=not args.no_report,
    )


def _cmd_report(args) -> int:
    from m2po_rllib.jobs.report import run_report

    return run_report(args.dirs, out=args.out, last_k=args.last_k, margin=args.margin)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as e:  # what a user can fix; anything else is a bug
        print(f"m2po {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before a job had anything to save (train handles its own)
        print(f"m2po {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
