"""Issue 31 diagnosis: is the lr 2e-3 run chaotic? 1F1B-flush with a small random error on its forward weights.

Every forward of stages 0..S-2 runs on ``w + e`` (then the real weights are put back, as weight prediction
does), ``e`` Gaussian with ``|e| = rel * |last update of the stage|``: the size of weight prediction's measured
error (a few % to ~30% of one step). If flush then ends far from its unperturbed loss, the final loss at this
learning rate depends on errors of that size, whatever their source.

    PYTHONPATH=. python -m benchmarks.exp31_perturb --rel 0.05
"""

from __future__ import annotations

import torch

from benchmarks import paci_at_depth as depth
from benchmarks.harness import write_json
from lit_efficient.runtime import stage as stage_mod


def main() -> None:
    p = depth.line_options("flush")
    p.add_argument("--rel", type=float, default=0.05)
    p.add_argument("--noise-seed", type=int, default=1234)
    p.add_argument("--coherent", action="store_true", help="e = rel * (last update) instead of Gaussian noise")
    args = p.parse_args()
    config = depth.grid_line_config(args)
    gen = torch.Generator().manual_seed(args.noise_seed)
    last: dict[int, list[torch.Tensor]] = {}
    orig_forward, orig_step = stage_mod.PipelineStage.forward, stage_mod.PipelineStage.step

    def step(self, window=-1):
        before = [q.detach().clone() for q in self.parameters()]
        orig_step(self, window)
        last[self.stage] = [q.detach() - b for q, b in zip(self.parameters(), before, strict=True)]

    def forward(self, microbatch, inputs, batch=None, pending_steps=0):
        upd = last.get(self.stage)
        if self.is_last or upd is None or args.rel == 0:
            return orig_forward(self, microbatch, inputs, batch, pending_steps)
        params = list(self.parameters())
        versions = tuple(q._version for q in params)
        saved = [q.detach().clone() for q in params]
        norm = torch.sqrt(sum((u.float() ** 2).sum() for u in upd))
        noise = [torch.randn(q.shape, generator=gen) for q in params]
        nnorm = torch.sqrt(sum((n**2).sum() for n in noise))
        with torch.no_grad():
            for q, n, u in zip(params, noise, upd, strict=True):
                q.add_(args.rel * u if args.coherent else n * (args.rel * norm / nnorm))
        torch._C._autograd._unsafe_set_version_counter(tuple(params), versions)
        try:
            return orig_forward(self, microbatch, inputs, batch, pending_steps)
        finally:
            with torch.no_grad():
                for q, b in zip(params, saved, strict=True):
                    q.copy_(b)
            torch._C._autograd._unsafe_set_version_counter(tuple(params), versions)

    stage_mod.PipelineStage.forward, stage_mod.PipelineStage.step = forward, step
    result = depth.fit_one(config, args.stages, args.accumulate, args.lr, args.seed, args.run)
    print(
        "final",
        "coherent" if args.coherent else "noise",
        args.rel,
        result["final_val_loss"],
        [round(v, 3) for _, v in result["val"]],
    )
    if args.out:
        write_json(args.out, {"args": vars(args), "result": result})


if __name__ == "__main__":
    main()
