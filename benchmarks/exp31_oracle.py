"""Issue 31 diagnosis: PACI with an oracle forward. Is PACI with exact stale weights the same training as flush?

``--mode record``: a 1F1B-flush run, saving every stage's weights after every step (and at the start).
``--mode replay``: a PACI run in which every forward of a micro-batch that ``pending_steps`` separate from its
backward runs on the recorded flush weights of version ``version + pending_steps`` (the weights its gradient
is applied to); after each step the stage's weights are compared with flush's of the same version. If PACI
differed from flush only by its stale forwards, the two trajectories would stay equal (up to rounding).

    PYTHONPATH=. python -m benchmarks.exp31_oracle --mode record
    PYTHONPATH=. python -m benchmarks.exp31_oracle --mode replay
"""

from __future__ import annotations

import torch

from benchmarks import paci_at_depth as depth
from benchmarks.harness import write_json
from lit_efficient.runtime import stage as stage_mod


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]).clone()


def main() -> None:
    p = depth.line_options()
    p.add_argument("--mode", choices=["record", "replay"], required=True)
    p.add_argument("--only-stale", action="store_true", help="replay: replace the weights of stale forwards only")
    p.add_argument("--until", type=int, default=10**9, help="replay: oracle for target versions <= this, then --after")
    p.add_argument("--after", default="paci", help="replay: the run (correction) once the oracle stops")
    p.add_argument("--file", default="/tmp/exp31_flush_weights.pt")
    args = p.parse_args()
    config = depth.grid_line_config(args)
    orig_forward, orig_step = stage_mod.PipelineStage.forward, stage_mod.PipelineStage.step
    snaps: dict[tuple[int, int], torch.Tensor] = {}
    diffs: list[tuple[int, int, float]] = []

    if args.mode == "record":

        def forward(self, microbatch, inputs, batch=None, pending_steps=0):
            snaps.setdefault((self.stage, self.version), _flat(self.parameters()))
            return orig_forward(self, microbatch, inputs, batch, pending_steps)

        def step(self, window=-1):
            orig_step(self, window)
            snaps[(self.stage, self.version)] = _flat(self.parameters())

        run = "flush"
    else:
        flush = torch.load(args.file)

        def forward(self, microbatch, inputs, batch=None, pending_steps=0):
            target = flush.get((self.stage, self.version + pending_steps))
            if target is None or (args.only_stale and pending_steps == 0) or self.version + pending_steps > args.until:
                return orig_forward(self, microbatch, inputs, batch, pending_steps)
            params = list(self.parameters())
            versions = tuple(q._version for q in params)
            saved = [q.detach().clone() for q in params]
            with torch.no_grad():
                offset = 0
                for q in params:
                    q.copy_(target[offset : offset + q.numel()].view_as(q))
                    offset += q.numel()
            torch._C._autograd._unsafe_set_version_counter(tuple(params), versions)
            try:
                return orig_forward(self, microbatch, inputs, batch, 0)  # 0: no correction on the oracle's weights
            finally:
                with torch.no_grad():
                    for q, b in zip(params, saved, strict=True):
                        q.copy_(b)
                torch._C._autograd._unsafe_set_version_counter(tuple(params), versions)

        def step(self, window=-1):
            orig_step(self, window)
            ref = flush.get((self.stage, self.version))
            if ref is not None and self.version <= args.until + 3:
                w = _flat(self.parameters())
                diffs.append((self.stage, self.version, ((w - ref).norm() / ref.norm()).item()))

        run = args.after

    stage_mod.PipelineStage.forward, stage_mod.PipelineStage.step = forward, step
    result = depth.fit_one(config, args.stages, args.accumulate, args.lr, args.seed, run)
    print("final", args.mode, result["final_val_loss"], [round(v, 3) for _, v in result["val"]])
    if args.mode == "record":
        torch.save(snaps, args.file)
    else:
        for s in range(args.stages):
            row = [(v, d) for st, v, d in diffs if st == s]
            pick = [row[i] for i in (0, 1, 2, 4, 9, 19, 39, 79, len(row) - 1) if i < len(row)]
            print(f"stage {s}: |w - w_flush| / |w_flush| at steps", " ".join(f"{v}:{d:.1e}" for v, d in pick))
    if args.out:
        write_json(args.out, {"args": vars(args), "result": result, "diffs": diffs})


if __name__ == "__main__":
    main()
