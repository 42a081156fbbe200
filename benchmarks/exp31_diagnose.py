"""Issue 31 diagnosis: how well do candidate predictions of a stale stage's weights match the weights reached?

Runs one grid run of `paci_at_depth` (in process) with `PipelineStage.forward` and `.step` wrapped: at each
forward with ``pending_steps`` d > 0 it evaluates several predictions of the weight change over the next d
steps (without changing what the run does), and once the stage has taken those d steps compares each with
the change that happened, ``actual = w_{v+d} - w_v``:

- ``wp``: the current weight prediction, ``-d * lr * u`` with the window's gradient so far folded in;
- ``mom``: the same without the fold (the current moments alone: SpecTrain's rule);
- ``last``: ``d * (w_v - w_{v-1})``, the last applied update repeated (momentum look-ahead, mu = 1).
- ``shrunk``: ``wp`` with the window's mean so far shrunk towards the momentum, ``f * mean + (1 - f) * m_hat`` (f: the
  share of the window accumulated): the accumulated share exact, the momentum for the share still to come;
- ``mfold``: ``wp`` with the mean folded into the first moment only (a young window's mean squared overstates the
  full window's ``g^2``, so folding it into ``v`` shrinks the step: a coherent undershoot where noise dominates).

Per prediction: relative error ``|pred - actual| / |actual|`` (1 = no better than no prediction),
cosine, the norm ratio ``|pred| / |actual|`` (> 1: overshoot) and the error's signed component along the step
taken, ``<pred - actual, actual> / |actual|^2`` (< 0: short of it; the mean, a coherent error's measure), per stage
and per phase of training (a long run's later phases by quarters) and by the share of the window accumulated.

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


def _m_fold_only(optimizer, params, weight) -> torch.Tensor:
    """AdamW's pending step with the window's mean folded into the first moment only: ``v`` as it is (the mean of a
    young window's few micro-batches squared overstates the full window's ``g^2``: a coherent undershoot). In the
    order of ``params``, as the other predictions."""
    groups = {id(q): group for group in optimizer.param_groups for q in group["params"]}
    out = []
    for q in params:
        state, group = optimizer.state.get(q), groups.get(id(q))
        if not state or group is None or q.grad is None:
            continue
        lr, wd, (b1, b2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        t = float(state["step"])
        m = b1 * state["exp_avg"] + (1 - b1) * q.grad / weight
        u = (m / (1 - b1 ** (t + 1))) / ((state["exp_avg_sq"] / (1 - b2**t)).sqrt() + eps) + wd * q
        out.append((lr * u).reshape(-1).float())
    return torch.cat(out)


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
                share = min(1.0, self._window_microbatches / self_accumulate[0])
                for name, w, f in (("wp", weight, None), ("mom", None, None), ("shrunk", weight, share)):
                    steps = predicted_steps(self.optimizer, w, f)
                    preds[name] = -d * torch.cat(
                        [steps[id(q)](q).reshape(-1).float() for q in params if id(q) in steps]
                    )
                if weight is not None:
                    preds["mfold"] = -d * _m_fold_only(self.optimizer, params, weight)
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
                        # The error's signed component along the step taken (< 0: the prediction falls short).
                        "along": torch.dot(pred - actual, actual).item() / an**2,
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
    phases = [(0, 5), (5, 20), (20, 60)]
    # A long run's later phases by quarters: a gap that builds late shows where the error turns coherent.
    cuts = [60] + [q * steps // 4 for q in (1, 2, 3) if q * steps // 4 > 60] + [steps + 1]
    phases += list(zip(cuts, cuts[1:], strict=False))
    summary = []
    for s in range(args.stages):
        for lo, hi in phases:
            sel = [r for r in records if r["stage"] == s and lo <= r["version"] < hi]
            if not sel:
                continue
            row = {"stage": s, "phase": f"{lo}-{hi}", "n": len(sel)}
            for name in ("wp", "mom", "last", "shrunk", "mfold"):
                vals = [r[name] for r in sel if name in r]
                if vals:
                    row[name] = {k: statistics.median(v[k] for v in vals) for k in ("rel_err", "cos", "ratio")}
                    row[name]["along"] = statistics.fmean(v["along"] for v in vals)
            row["rel_step"] = statistics.median(r["actual_norm"] / r["weight_norm"] for r in sel)
            summary.append(row)
            print(
                f"stage {s} steps {lo:>3}-{hi:<3} n={len(sel):4d} |dw|/|w|={row['rel_step']:.4f} "
                + " ".join(
                    f"{n}: err {row[n]['rel_err']:.2f} cos {row[n]['cos']:.2f} ratio {row[n]['ratio']:.2f} "
                    f"along {row[n]['along']:+.3f}"
                    for n in ("wp", "mom", "last", "shrunk", "mfold")
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
                    f"ratio {statistics.median(r[n]['ratio'] for r in sel):.2f} "
                    f"along {statistics.fmean(r[n]['along'] for r in sel):+.3f}"
                    for n in ("wp", "mom", "last", "shrunk", "mfold")
                    if all(n in r for r in sel)
                )
            )
    if args.out:
        write_json(args.out, {"args": vars(args), "result": result, "summary": summary, "records": records})


if __name__ == "__main__":
    main()
