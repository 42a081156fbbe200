"""Issue 31 diagnosis: weight prediction on a subset of the stages only (the others plain PACI).

PYTHONPATH=. python -m benchmarks.exp31_subset --only 0          # stage 0 predicted, the rest plain
PYTHONPATH=. python -m benchmarks.exp31_subset --only 1 2 3 4 5 6
"""

from __future__ import annotations

from benchmarks import paci_at_depth as depth
from benchmarks.harness import write_json
from lit_efficient.strategy import paci


def main() -> None:
    p = depth.line_options("paci+weight_prediction")
    p.add_argument("--only", type=int, nargs="+", required=True)
    args = p.parse_args()
    config = depth.grid_line_config(args)
    make = paci.make_correction

    def make_subset(name, schedule, stage, *rest):
        return make(name, schedule, stage, *rest) if stage in args.only else None

    paci.make_correction = make_subset
    result = depth.fit_one(config, args.stages, args.accumulate, args.lr, args.seed, args.run)
    print("final", args.only, result["final_val_loss"], [round(v, 3) for _, v in result["val"]])
    if args.out:
        write_json(args.out, {"args": vars(args), "result": result})


if __name__ == "__main__":
    main()
