"""Issue 31 diagnosis: how well do candidate predictions of a stale stage's weights match the weights reached?

Runs one grid run of `paci_at_depth` (in process) with `PipelineStage.forward` and `.step` wrapped: at each
forward with ``pending_steps`` d > 0 it evaluates several predictions of the weight change over the next d
steps (without changing what the run does), and once the stage has taken those d steps compares each with
the change that happened, ``actual = w_{v+d} - w_v``:

- ``wp``: the current weight prediction, ``-d * lr * u`` with the window's gradient so far folded in;
- ``mom``: the same without the fold (the current moments alone: SpecTrain's rule);
- ``last``: ``d * (w_v - w_{v-1})``, the last applied update repeated (momentum look-ahead, mu = 1).

Per prediction: relative error ``|pred - actual| / |actual|`` (1 = no better than no prediction),
cosine, and the norm ratio ``|pred| / |actual|`` (> 1: overshoot), per stage and per phase of training.

    PYTHONPATH=. python -m benchmarks.exp31_diagnose --stages 8 --accumulate 8 --lr 2e-3 --run paci+weight_prediction
"""

from __future__ import annotations

import statistics

import torch

from benchmarks import paci_at_depth as depth
from benchmarks.harness import write_json
from lit_efficient.runtime import stage as stage_mod
from lit_efficient.runtime.staleness import predicted_steps


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def main() -> None:
    p = depth.line_options("paci+weight_prediction")
    args = p.parse_args()
    config = depth.grid_line_config(args)

    snaps: dict[tuple[int, int], torch.Tensor] = {}  # (stage, version) -> flat weights
    pending: list[dict] = []  # predictions waiting for their target version
    records: list[dict] = []
    orig_forward, orig_step = stage_mod.PipelineStage.forward, stage_mod.PipelineStage.step

    def forward(self, microbatch, inputs, batch=None, pending_steps=0):
        params = list(self.parameters())
        key = (self.stage, self.version)
        if key not in snaps:
            snaps[key] = _flat(params)
        if pending_steps > 0 and self.optimizer is not None and self.optimizer.state:
            d = pending_steps
            weight = self._window[0] if self._window is not None else None
            preds = {}
            with torch.no_grad():
                for name, w in (("wp", weight), ("mom", None)):
                    steps = predicted_steps(self.optimizer, w)
                    preds[name] = -d * torch.cat(
                        [steps[id(q)](q).reshape(-1).float() for q in params if id(q) in steps]
                    )
                prev = snaps.get((self.stage, self.version - 1))
                if prev is not None:
                    preds["last"] = d * (snaps[key] - prev)
            frac = 0.0 if weight is None else float(weight) / self_accumulate[0]
            pending.append({"stage": self.stage, "version": self.version, "d": d, "frac": frac, "preds": preds})
        return orig_forward(self, microbatch, inputs, batch, pending_steps)

    def step(self, window=-1):
        orig_step(self, window)
        snaps[(self.stage, self.version)] = _flat(self.parameters())
        snaps.pop((self.stage, self.version - 3), None)
        keep = []
        for rec in pending:
            if rec["stage"] == self.stage and rec["version"] + rec["d"] == self.version:
                actual = snaps[(self.stage, self.version)] - snaps[(self.stage, rec["version"])]
                an = actual.norm().item()
                out = {k: rec[k] for k in ("stage", "version", "d", "frac")}
                out["actual_norm"] = an
                out["weight_norm"] = snaps[(self.stage, self.version)].norm().item()
                for name, pred in rec["preds"].items():
                    out[name] = {
                        "rel_err": (pred - actual).norm().item() / an,
                        "cos": torch.nn.functional.cosine_similarity(pred, actual, dim=0).item(),
                        "ratio": pred.norm().item() / an,
                    }
                records.append(out)
            else:
                keep.append(rec)
        pending[:] = keep

    self_accumulate = [args.accumulate]
    stage_mod.PipelineStage.forward, stage_mod.PipelineStage.step = forward, step
    result = depth.fit_one(config, args.stages, args.accumulate, args.lr, args.seed, args.run)
    print("final", result["final_val_loss"], [round(v, 3) for _, v in result["val"]])
    steps = result["steps"]
    phases = [(0, 5), (5, 20), (20, 60), (60, steps + 1)]
    summary = []
    for s in range(args.stages):
        for lo, hi in phases:
            sel = [r for r in records if r["stage"] == s and lo <= r["version"] < hi]
            if not sel:
                continue
            row = {"stage": s, "phase": f"{lo}-{hi}", "n": len(sel)}
            for name in ("wp", "mom", "last"):
                vals = [r[name] for r in sel if name in r]
                if vals:
                    row[name] = {k: statistics.median(v[k] for v in vals) for k in ("rel_err", "cos", "ratio")}
            row["rel_step"] = statistics.median(r["actual_norm"] / r["weight_norm"] for r in sel)
            summary.append(row)
            print(
                f"stage {s} steps {lo:>3}-{hi:<3} n={len(sel):4d} |dw|/|w|={row['rel_step']:.4f} "
                + " ".join(
                    f"{n}: err {row[n]['rel_err']:.2f} cos {row[n]['cos']:.2f} ratio {row[n]['ratio']:.2f}"
                    for n in ("wp", "mom", "last")
                    if n in row
                )
            )
    # By window progress (fraction of the window accumulated at the forward), all stages, steps >= 5.
    for lo, hi in ((0, 0.26), (0.26, 0.51), (0.51, 0.76), (0.76, 1.01)):
        sel = [r for r in records if lo <= r["frac"] < hi and r["version"] >= 5]
        if sel:
            print(
                f"frac {lo:.2f}-{hi:.2f} n={len(sel):4d} "
                + " ".join(
                    f"{n}: err {statistics.median(r[n]['rel_err'] for r in sel):.2f} "
                    f"ratio {statistics.median(r[n]['ratio'] for r in sel):.2f}"
                    for n in ("wp", "mom", "last")
                )
            )
    if args.out:
        write_json(args.out, {"args": vars(args), "result": result, "summary": summary, "records": records})


if __name__ == "__main__":
    main()
