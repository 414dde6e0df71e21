"""Ray Tune search over M2PO's threshold (tau) and the data staleness.

    python tune/threshold_staleness.py --config configs/default.yaml --iters 200 \
        --thresholds 0.02 0.04 0.08 --staleness 0 64 256

Each trial is an `M2PO` run of the given config with one (m2_threshold, staleness) pair;
Tune writes TensorBoard logs and a result table under --storage.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--iters", type=int, default=200, help="training iterations per trial")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.02, 0.04, 0.08])
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 64, 256])
    p.add_argument("--storage", default=str(Path("runs/tune").resolve()))
    p.add_argument("--max-concurrent", type=int, default=1, help="trials at a time")
    p.add_argument("overrides", nargs="*", help="section.key=value for every trial")
    args = p.parse_args()

    import ray
    from ray import tune

    from m2po_rllib.config_io import apply_overrides, config_from_spec, load_spec

    spec = apply_overrides(load_spec(args.config), args.overrides)
    spec.pop("run", None)
    config = config_from_spec(spec).training(
        m2_threshold=tune.grid_search(args.thresholds),
        staleness=tune.grid_search(args.staleness),
    )
    ray.init(ignore_reinit_error=True)
    tuner = tune.Tuner(
        "M2PO",
        param_space=config,
        tune_config=tune.TuneConfig(max_concurrent_trials=args.max_concurrent),
        run_config=tune.RunConfig(
            name="m2po-threshold-staleness",
            storage_path=args.storage,
            stop={"training_iteration": args.iters},
        ),
    )
    grid = tuner.fit()
    key = "evaluation/env_runners/eval/accuracy"
    df = grid.get_dataframe()
    cols = [c for c in ("config/m2_threshold", "config/staleness", key, "training_iteration") if c in df]
    print(df[cols].sort_values(cols[:2]).to_string(index=False))


if __name__ == "__main__":
    main()
