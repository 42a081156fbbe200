"""Issue 31: one table from the exp31_*.json grid results: final validation loss and gap against flush per
candidate and grid line (flush does not depend on S: the in-process pipeline is bit-identical to flush's
unsplit order, so one flush run per (N, lr, seed) serves every S), with the median over seeds where 3 ran.

    python -m benchmarks.exp31_table                  # the table, the time to accuracy, the curves
    python -m benchmarks.exp31_table --measure-costs  # first, on a quiet machine: results/exp31_layer_costs.json
    python -m benchmarks.exp31_table --by-size        # the prediction's share against micro-batch size
    python -m benchmarks.exp31_table --rule-cost      # the default's rule against the previous one, per block
    python -m benchmarks.exp31_table --measure-paper-shape  # the paper's model: exp31_layer_costs_paper_shape.json
    python -m benchmarks.exp31_table --measure-paper-shape --device cuda  # the same on a GPU (bf16): ..._cuda.json
    python -m benchmarks.exp31_table --paper-shape --device cuda  # its table again from the file, no measuring

The time to accuracy takes its per-layer costs (forward, backward and the default prediction's apply + undo) from
results/exp31_layer_costs.json, measured in one quiet process, so that every row uses one set; without that file,
from the first grid file of PACI's defaults (no prediction cost: those rows then leave it out, and say so).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
GRID_STEPS = 1200  # micro-batches per run of the grid (equal tokens for every N)
COSTS = RESULTS / "exp31_layer_costs.json"
DEFAULTS = ("paci_default", "paci_default_compiled")  # PACIStrategy(schedule="paci")'s rule, eager and compiled
# The files whose default runs ran the previous rule (the window's mean squared folded whole into Adam's v; until
# 2026-12-03, sixth session): "whole" tables read their default runs, "share" tables (the default now: the square
# folded for the share of the window accumulated) every other file's. Runs of other names are read from every file.
WHOLE_FOLD = frozenset(
    f"exp31_{name}.json"
    for name in (
        "compiled_s8n8", "default_long_s8n8_lr2e-3", "default_s4n4_lr2e-3", "default_s4n8_lr2e-3",
        "default_s8n16_lr2e-3", "default_s8n4_lr2e-3", "default_s8n8_lr2e-3", "default_s8n8_lr5e-4_1e-3",
        "long14_s8n8", "long14_s8n8_lr2e-3_eager_plain", "long14_s8n8_lr2e-3_seeds", "long14x4_s8n8_lr1e-3_seed0",
        "long14x4_s8n8_lr2e-3", "long14x4_s8n8_lr2e-3_seed1", "long14x4_s8n8_lr2e-3_seed2",
        "long14x4_s8n8_lr5e-4_seed0", "sync20_s4n4_lr2e-3", "sync20_s8n4_lr2e-3",
    )
)  # fmt: skip


def _payloads(rule: str = "share") -> Iterator[tuple[Path, dict]]:
    """Every exp31 result file with its runs, those of the default's names only where the file ran ``rule``
    ("share", "whole" or "both")."""
    for path in sorted(RESULTS.glob("exp31_*.json")):
        payload = json.loads(path.read_text())
        era = "whole" if path.name in WHOLE_FOLD else "share"
        if rule != "both" and payload.get("runs"):
            payload["runs"] = [r for r in payload["runs"] if r["run"] not in DEFAULTS or era == rule]
        yield path, payload


def measure_costs() -> Path:
    """The grid model's per-layer forward, backward and prediction seconds on this machine (one thread)."""
    import time

    from benchmarks.harness import envelope, machine, write_json
    from benchmarks.paci_at_depth import grid_line_config, layer_costs

    config, start, before = grid_line_config(), time.perf_counter(), machine()
    costs = layer_costs(config, repeats=21)
    payload = envelope("exp31_table", False, before, config, start, layer_costs=costs)
    payload["command"] = "python -m benchmarks.exp31_table --measure-costs"
    return write_json(COSTS.name, payload)


SIZES = {  # name -> benchmark options: the grid's micro-batch, 4x its tokens, and a 4x wider model at 1,024 tokens
    "grid: GPT 6x64, 8 x 32 tokens": ["--block", "32", "--dim", "64"],
    "GPT 6x64, 32 x 32 tokens": ["--block", "32", "--dim", "64", "--batch-size", "32"],
    "GPT 6x256, 8 x 128 tokens": ["--block", "128", "--dim", "256"],
}


# The paper's model and micro-batch (GPT-2 Medium: 24 blocks of width 1024, 16 heads, GPT-2's 50,257 token ids
# padded to 50,304; global batch 128 = N 8 x 16 sequences of 1,024 tokens). Its blocks are alike, so one is timed.
# Costs only, no pipeline is built: hence one stage.
# fmt: off
PAPER_SHAPE = ["--layers", "1", "--dim", "1024", "--heads", "16", "--block", "1024", "--batch-size", "16",
               "--vocab", "50304", "--stages", "1"]
# fmt: on
PAPER_BLOCKS = 24
PAPER_COSTS = RESULTS / "exp31_layer_costs_paper_shape.json"  # this CPU's; on a GPU: ..._cuda.json


def _paper_costs_file(device: str) -> Path:
    return PAPER_COSTS if device == "cpu" else PAPER_COSTS.with_name(f"{PAPER_COSTS.stem}_{device}.json")


def measure_paper_shape(device: str = "cpu") -> Path:
    """Per-layer costs (forward, backward, the prediction's apply + undo, eager and compiled) of the paper's model
    at its micro-batch: the embedding, one block, the head. On CPU one thread, medians of 3 rounds (~6 minutes);
    on CUDA under bf16 autocast, 21 rounds (`paci_at_depth.layer_costs`), and a whole stage's window
    (`stage_costs`: four blocks, as the paper's split puts them)."""
    import time

    from benchmarks.harness import envelope, machine, write_json
    from benchmarks.paci_at_depth import layer_costs, parse_args

    config = vars(parse_args([*PAPER_SHAPE, "--cost-device", device]))
    start, before = time.perf_counter(), machine()
    costs = layer_costs(config, repeats=3 if device == "cpu" else 21)
    extra = {"stage_costs": stage_costs(config, blocks=4, rounds=7)} if device == "cuda" else {}
    payload = envelope("exp31_table", False, before, config, start, layer_costs=costs, **extra)
    payload["command"] = "python -m benchmarks.exp31_table --measure-paper-shape" + (
        f" --device {device}" if device != "cpu" else ""
    )
    if device == "cuda":
        import torch

        payload["gpu"] = torch.cuda.get_device_name()
    return write_json(_paper_costs_file(device).name, payload)


def stage_costs(config: dict, blocks: int = 4, micro_batches: int = 8, rounds: int = 5) -> dict:
    """Seconds per micro-batch of one stage of ``blocks`` GPT blocks over a window of ``micro_batches`` (forward,
    then backward, the host never waiting: one synchronization per window, as a stage's process runs), with every
    forward on plain weights (``none``) or predicted by PACI's default, eager or compiled (every forward stale: a
    stage s of S pays this for (S-1-s)/N of its forwards). What a pipeline stage pays for the prediction, the
    host's time included only where the host falls behind the GPU: the check on `layer_costs`' two timings of the
    prediction. Medians of ``rounds`` rounds after one untimed (which compiles), the forms in turn in each."""
    import time

    import torch

    from benchmarks.paci_at_depth import _autocast, _model, _synchronize, prediction_contexts

    device = torch.device(config.get("cost_device", "cpu"))
    torch.manual_seed(0)
    stage = torch.nn.Sequential(*list(_model({**config, "layers": blocks}, 1e-3, 100).pipeline_layers())[1:-1])
    stage = stage.to(device)
    context = prediction_contexts(list(stage.parameters()), config)
    forms = ("none", "eager", "compiled")  # "none": plain weights
    x = torch.randn(config["batch_size"], config["block"], config["dim"], device=device)

    def window(form: str) -> float:
        _synchronize(device)
        t0 = time.perf_counter()
        for _ in range(micro_batches):
            with context(None if form == "none" else form), _autocast(device):
                out = stage(x.detach().requires_grad_())
            out.float().backward(torch.ones_like(out, dtype=torch.float32))
        _synchronize(device)
        return (time.perf_counter() - t0) / micro_batches

    times: dict[str, list[float]] = {form: [] for form in forms}
    for _ in range(rounds + 1):
        for form in forms:
            times[form].append(window(form))
    return {
        "blocks": blocks, "micro_batches": micro_batches, "rounds": rounds,
        **{form: statistics.median(t[1:]) for form, t in times.items()},
    }  # fmt: skip


def paper_shape_table(path: Path | None = None, rule: str = "share") -> str:
    """The paper's model on S=8 (its blocks split by time, as its partitioner and ``balance="profile"`` do), each
    step timed from the measured costs of `measure_paper_shape` (``path``: its file; this CPU's by default): the
    throughput over flush of plain PACI and of the defaults with each prediction; then every S=8 N=8 run of PACI's
    defaults timed so, to the lowest loss both runs reach (its curve is the small model's: the step times are the
    paper model's)."""
    from benchmarks.paci_at_depth import lowest_both_reach, paci_seconds, steps_to

    payload = json.loads((path or PAPER_COSTS).read_text())
    measured, device = payload["layer_costs"], payload.get("gpu", "one CPU thread")
    split, per_step = _paper_step_seconds(measured)
    ratio = {key: v["1f1b_flush"] / v["paci"] for key, v in per_step.items()}
    digits = 2 if "gpu" in payload else 0  # a GPU's milliseconds are small; one CPU thread's are thousands
    ms = {k: f"{v[1] * 1e3:,.{digits}f}" for k, v in measured.items()}
    forms = [form for form in ("predict", "predict_compiled", "predict_gpu", "predict_compiled_gpu") if form in ratio]
    lines = [
        f"paper's shape, {device}: a block's forward / backward {ms['forward']} / {ms['backward']} ms, its "
        f"prediction eager / compiled {ms['predict']} / {ms['predict_compiled']} ms; head forward / backward "
        f"{measured['forward'][2] * 1e3:,.{digits}f} / {measured['backward'][2] * 1e3:,.{digits}f} ms; split {split}; "
        f"S=8 N=8 throughput over flush: plain {ratio[None]:.2f}x, eager {ratio['predict']:.2f}x, compiled "
        f"{ratio['predict_compiled']:.2f}x (ideal {15 / 8:.3f}x)",
    ]
    if "predict_gpu" in ratio:  # CUDA: the prediction's kernels alone, the host ahead of the GPU
        lines.append(
            f"the prediction's kernels alone (the host ahead): a block's eager / compiled {ms['predict_gpu']} / "
            f"{ms['predict_compiled_gpu']} ms; S=8 N=8 throughput over flush with them: eager "
            f"{ratio['predict_gpu']:.2f}x, compiled {ratio['predict_compiled_gpu']:.2f}x"
        )
    if "stage_costs" in payload:
        st = payload["stage_costs"]
        per_block = {form: (st[form] - st["none"]) / st["blocks"] * 1e3 for form in ("eager", "compiled")}
        lines.append(
            f"a stage of {st['blocks']} blocks, {st['micro_batches']} micro-batches, every forward predicted, per "
            f"micro-batch: plain {st['none'] * 1e3:.2f} ms, eager {st['eager'] * 1e3:.2f} ms, compiled "
            f"{st['compiled'] * 1e3:.2f} ms: the prediction adds {per_block['eager']:.2f} / "
            f"{per_block['compiled']:.2f} ms per block (eager / compiled)"
        )
    lines += [
        "",
        "| layers | steps | lr | seed | to the lowest both reach, " + " | ".join(_FORM_NAMES[f] for f in forms) + " |",
        "|" + "---|" * (4 + len(forms)),
    ]
    for n, layers, steps, lr, seed, f, r in _default_pairs(rule):
        if n != 8:
            continue
        both = lowest_both_reach(f["val"], r["val"])
        to_flush, to_paci, sync = steps_to(f["val"], both), steps_to(r["val"], both), r.get("sync_start_steps", 0)
        cells = []
        for form in forms:
            flush_step, paci_step = per_step[form]["1f1b_flush"], per_step[form]["paci"]
            cells.append(f"{to_flush * flush_step / paci_seconds(to_paci, sync, flush_step, paci_step):.2f}")
        lines.append(f"| {layers} | {steps} | {lr:g} | {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


_FORM_NAMES = {
    "predict": "eager",
    "predict_compiled": "compiled",
    "predict_gpu": "eager, kernels alone",
    "predict_compiled_gpu": "compiled, kernels alone",
}


def _paper_step_seconds(measured: dict[str, list[float]]) -> tuple[list[int], dict]:
    """The paper model's split over S=8 (by time, as ``balance="profile"``) and its simulated S=8 N=8 step seconds per
    schedule, for plain PACI (key None) and each form of the prediction, from one block's, the embedding's and the
    head's measured costs."""
    from benchmarks.paci_at_depth import simulated_step_seconds
    from lit_efficient.runtime.partition import partition_balanced

    costs = {k: [v[0]] + [v[1]] * PAPER_BLOCKS + [v[2]] for k, v in measured.items()}
    split = partition_balanced([f + b for f, b in zip(costs["forward"], costs["backward"], strict=True)], 8)
    return split, {
        key: simulated_step_seconds(costs, 8, 8, key, split)
        for key in (None, "predict", "predict_compiled", "predict_gpu", "predict_compiled_gpu")
        if key is None or key in costs
    }


def long_lines_table(rule: str = "share") -> str:
    """The issue's own measure on the lines longer than the grid: per S=8 N=8 pair (flush, PACI's defaults), both
    final losses on the curve's validation batches and, where the run validated its final models on the whole split
    (``--final-val-batches -1``), there too; the step at which PACI first reaches flush's final loss, and the
    simulated time ratio to it with GPT-2 Medium's measured step times (compiled prediction) and at the ideal
    throughput ("never" where PACI's curve stays above flush's final loss); where PACI's final model is at or below
    flush's on the whole split, the ratio it bounds from below with GPT-2 Medium's costs (PACI reached flush's final
    loss by its last step at the latest; flush's at its last)."""
    from benchmarks.paci_at_depth import paci_seconds, steps_to

    per_step = _paper_step_seconds(json.loads(PAPER_COSTS.read_text())["layer_costs"])[1]["predict_compiled"]
    flush_step, paci_step = per_step["1f1b_flush"], per_step["paci"]
    steps_at = [(flush_step, paci_step)]
    gpu = _paper_costs_file("cuda")
    if gpu.exists():  # the H200's GPT-2 Medium costs, the compiled prediction's kernels alone (what a stage pays)
        on_gpu = _paper_step_seconds(json.loads(gpu.read_text())["layer_costs"])[1]["predict_compiled_gpu"]
        steps_at.append((on_gpu["1f1b_flush"], on_gpu["paci"]))
    lines = [
        "| layers | steps | lr | seed | curve's tokens | flush | PACI (gap) | whole split: flush | PACI (gap) | "
        "PACI's step at flush's final | to flush's final: GPT-2 Medium's costs (this CPU) | "
        + ("H200 | " if gpu.exists() else "")
        + "ideal | whole split: at least |",
        "|" + "---|" * (13 + gpu.exists()),
    ]
    for n, layers, steps, lr, seed, f, r in _default_pairs(rule):
        if n != 8 or steps * n <= GRID_STEPS:
            continue
        target, sync = f["val"][-1][1], r.get("sync_start_steps", 0)
        to_flush, to_paci = steps_to(f["val"], target), steps_to(r["val"], target)
        ratios = [to_flush * a / paci_seconds(to_paci, sync, a, b) for a, b in [*steps_at, (1, n / (n + 8 - 1))]]
        wide, bound = "- | -", "-"
        if "final_val_loss_wide" in f and "final_val_loss_wide" in r:
            fw, rw = f["final_val_loss_wide"], r["final_val_loss_wide"]
            wide = f"{fw:.4f} | {rw:.4f} ({rw / fw - 1:+.2%})"
            # PACI's final model at or below flush's on the whole split: it reached flush's final loss by its last
            # step at the latest, so the ratio is at least this (flush's whole curve against all of PACI's steps)
            bound = (
                f">= {steps * flush_step / paci_seconds(steps, sync, flush_step, paci_step):.3f}"
                if rw <= fw
                else "above"
            )
        lines.append(
            f"| {layers} | {steps} | {lr:g} | {seed} | {r['val_tokens']:,} | {target:.4f} | {r['val'][-1][1]:.4f} "
            f"({r['val'][-1][1] / target - 1:+.2%}) | {wide} | "
            + (f"{to_paci:.0f} | " if to_paci == to_paci else "never | ")
            + " | ".join(f"{x:.2f}" if x == x else "never" for x in ratios)
            + f" | {bound} |"
        )
    return "\n".join(lines)


def noise_floor_table(rule: str = "share") -> str:
    """The long lines' spread against PACI's gap (issue 31's deep line): per lr, flush with a 5% random error on its
    forward weights (`exp31_perturb`, one row per noise seed) against the same seed's flush, and PACI's defaults
    against theirs, on the curve and on the whole split; then per lr the median, the range and the count above
    flush of each. A gap inside the perturbed runs' spread is a trajectory's chaos, not the rule's bias."""
    from benchmarks.paci_at_depth import grid_line_config

    def line(r: dict, val_tokens: int) -> tuple:  # what makes two runs comparable: the deep line, the same sample
        return r["S"], r["N"], r["steps"], r["tokens_per_step"], val_tokens, r["lr"], r["seed"]

    pairs = [(f, r) for n, layers, steps, lr, seed, f, r in _default_pairs(rule) if (layers, n, steps) == (14, 8, 2400)]
    flush = {line(f, r["val_tokens"]): f for f, r in pairs}
    rows = {"perturbed flush": [], "PACI's defaults": [(line(f, r["val_tokens"]), "", r) for f, r in pairs]}
    for path in sorted(RESULTS.glob("exp31_perturb_long14*.json")):
        payload = json.loads(path.read_text())
        r, args = payload["result"], payload["args"]
        config = grid_line_config(argparse.Namespace(line_options=args.get("line_options", "")))
        key = line(r, _val_tokens(config))
        if key in flush:  # a perturbed run of another line (block, validation sample, length) has no pair here
            rows["perturbed flush"].append((key, f"noise {args['noise_seed']}", r))
    lines = ["| run | lr | seed | curve: gap vs flush | whole split: gap vs flush |", "|---|---|---|---|---|"]
    gaps: dict[tuple[str, float], list[tuple[float, float]]] = {}
    for name, found in rows.items():
        for key, label, r in sorted(found, key=lambda row: (row[0][-2], row[0][-1], row[1])):
            f, lr, seed = flush[key], key[-2], key[-1]
            curve = r["val"][-1][1] / f["val"][-1][1] - 1
            wide = r.get("final_val_loss_wide", float("nan")) / f.get("final_val_loss_wide", float("nan")) - 1
            gaps.setdefault((name, lr), []).append((curve, wide))
            lines.append(f"| {name} | {lr:g} | {seed}{' ' + label if label else ''} | {curve:+.2%} | {wide:+.2%} |")
    lines += ["", "| run | lr | runs | curve: median (range), above flush | whole split: median (range), above |",
              "|---|---|---|---|---|"]  # fmt: skip
    for (name, lr), found in sorted(gaps.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cells = []
        for values in zip(*found, strict=True):
            values = [v for v in values if v == v]
            cells.append(
                f"{statistics.median(values):+.2%} ({min(values):+.2%} to {max(values):+.2%}), "
                f"{sum(v > 0 for v in values)} of {len(values)}"
                if values
                else "-"
            )
        lines.append(f"| {name} | {lr:g} | {len(found)} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def by_size() -> Path:
    """Per model size: a block's forward, backward and prediction (apply + undo) times, and the simulated S=8 N=8
    throughput over flush of PACI without and with the prediction's time."""
    import time

    from benchmarks.harness import envelope, machine, write_json
    from benchmarks.paci_at_depth import layer_costs, parse_args, simulated_step_seconds

    start, before, rows = time.perf_counter(), machine(), []
    for name, argv in SIZES.items():
        config = vars(parse_args(argv))
        costs = layer_costs(config, repeats=9)
        plain = simulated_step_seconds(costs, 8, 8)
        predicted = simulated_step_seconds(costs, 8, 8, "predict")
        compiled = simulated_step_seconds(costs, 8, 8, "predict_compiled")
        rows.append({
            "model": name, "tokens_per_micro_batch": config["batch_size"] * config["block"],
            "block_forward_ms": costs["forward"][1] * 1e3, "block_backward_ms": costs["backward"][1] * 1e3,
            "block_predict_ms": costs["predict"][1] * 1e3,
            "block_predict_compiled_ms": costs["predict_compiled"][1] * 1e3,
            "throughput_plain": plain["1f1b_flush"] / plain["paci"],
            "throughput_with_prediction": predicted["1f1b_flush"] / predicted["paci"],
            "throughput_with_compiled_prediction": compiled["1f1b_flush"] / compiled["paci"],
        })  # fmt: skip
        r = rows[-1]
        times = (
            f"{r['block_forward_ms']:.2f} / {r['block_backward_ms']:.2f} | {r['block_predict_ms']:.2f} / "
            f"{r['block_predict_compiled_ms']:.2f}"
        )
        ratios = (
            f"{r['throughput_plain']:.2f}x | {r['throughput_with_prediction']:.2f}x / "
            f"{r['throughput_with_compiled_prediction']:.2f}x"
        )
        print(f"| {name} | {r['tokens_per_micro_batch']} | {times} | {ratios} |")
    payload = envelope("exp31_table", False, before, {}, start, rows=rows)
    payload["command"] = "python -m benchmarks.exp31_table --by-size"
    return write_json("exp31_prediction_by_size.json", payload)


def rule_cost(rounds: int = 31) -> Path:
    """The eager prediction's apply + undo on one block of each `SIZES` model, the default's rule (the square shrunk
    by the window's share: 3 of N = 8 micro-batches accumulated) against the previous rule (the whole fold), on the
    same weights and moments, one thread: ``rounds`` rounds each timing both in turn (first one, then the other,
    alternately), the median of each form's seconds and of the per-round ratios. The time-to-accuracy tables price
    the prediction from `measure_costs`, whose files were measured with the previous rule before 2026-12-03 (7th
    session); this is the rule's own cost beside them."""
    import statistics
    import time

    import torch

    from benchmarks.harness import envelope, machine, write_json
    from benchmarks.paci_at_depth import _model, parse_args, stale_optimizer
    from lit_efficient.runtime.staleness import InPlaceFirstStepWeightPrediction

    torch.set_num_threads(1)
    start, before, rows = time.perf_counter(), machine(), []
    for name, argv in SIZES.items():
        config = vars(parse_args(argv))
        torch.manual_seed(0)
        params = list(list(_model(config, 1e-3, 100).pipeline_layers())[1].parameters())  # the first block
        optimizer = stale_optimizer(params, config)
        weight = torch.tensor(3.0)
        previous, default = InPlaceFirstStepWeightPrediction(), InPlaceFirstStepWeightPrediction(8)
        forms = {"previous": (previous, None), "default": (default, 3)}

        def once(form: str, forms=forms, params=params, optimizer=optimizer, weight=weight) -> float:
            correction, microbatches = forms[form]
            t0 = time.perf_counter()
            with correction.forward_context(params, optimizer, 1, weight, window_microbatches=microbatches):
                pass
            return time.perf_counter() - t0

        times: dict[str, list[float]] = {"previous": [], "default": []}
        for r in range(rounds + 1):
            for form in ("previous", "default") if r % 2 else ("default", "previous"):
                times[form].append(once(form))
        ratios = [d / p for d, p in zip(times["default"][1:], times["previous"][1:], strict=True)]
        rows.append({
            "model": name, "weights": sum(p.numel() for p in params),
            "previous_ms": statistics.median(times["previous"][1:]) * 1e3,
            "default_ms": statistics.median(times["default"][1:]) * 1e3,
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        })  # fmt: skip
        r = rows[-1]
        print(
            f"| {name} | {r['weights']:,} | {r['previous_ms']:.2f} | {r['default_ms']:.2f} | "
            f"{r['ratio']:.3f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |"
        )
    payload = envelope("exp31_table", False, before, {"rounds": rounds}, start, rows=rows)
    payload["command"] = "python -m benchmarks.exp31_table --rule-cost"
    return write_json("exp31_rule_cost.json", payload)


def _costs(found: dict | None) -> dict | None:
    return json.loads(COSTS.read_text())["layer_costs"] if COSTS.exists() else found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module's docstring): at most one measurement or table, ``--device`` for the paper
    shape's. An unknown or misspelled option is refused by name (it would otherwise print the default tables)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--measure-costs", action="store_true", help="the grid model's per-layer costs")
    mode.add_argument("--measure-paper-shape", action="store_true", help="GPT-2 Medium's costs on --device, its table")
    mode.add_argument("--paper-shape", action="store_true", help="its table from the file, no measuring")
    mode.add_argument("--rule-cost", action="store_true", help="the default's rule against the previous one, per block")
    mode.add_argument("--by-size", action="store_true", help="the prediction's share against the micro-batch size")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="with the paper shape: where its costs are")
    args = p.parse_args(argv)
    if args.device != "cpu" and not (args.measure_paper_shape or args.paper_shape):
        p.error(f"--device {args.device} applies to --measure-paper-shape and --paper-shape only")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.measure_costs:
        print("wrote", measure_costs())
        return
    if args.measure_paper_shape or args.paper_shape:
        costs = _paper_costs_file(args.device)
        if args.measure_paper_shape:
            print("wrote", measure_paper_shape(args.device))
        elif not costs.exists():
            raise SystemExit(
                f"no costs of the paper's shape measured on {args.device} yet ({costs.name}): "
                f"measure them with --measure-paper-shape --device {args.device}"
            )
        print(paper_shape_table(costs))
        return
    if args.rule_cost:
        print("| model | block weights | previous rule, ms | the default's rule, ms | default / previous (range) |")
        print("|---|---|---|---|---|")
        print("wrote", rule_cost())
        return
    if args.by_size:
        print(
            "| model | tokens per micro-batch | block forward / backward, ms | prediction eager / compiled, ms | S=8 "
            "N=8 throughput over flush, plain | with the prediction, eager / compiled |\n|---|---|---|---|---|---|"
        )
        print("wrote", by_size())
        return
    runs = {}
    for path, payload in _payloads("both"):
        # exp31_diag_*: a grid run observed, not changed (its wrappers only read weights and moments); the
        # other diagnosis files (perturb, oracle, subset) changed their runs and are not grid results.
        found = payload.get("runs") or ([payload["result"]] if path.name.startswith("exp31_diag_") else [])
        for r in found:
            if r.get("steps", GRID_STEPS // r["N"]) * r["N"] != GRID_STEPS:
                continue  # a longer run (exp31_default_long_*): its own file's numbers, not this table's
            name = r["run"] + (" (whole fold)" if path.name in WHOLE_FOLD and r["run"] in DEFAULTS else "")
            runs[(r["S"], r["N"], r["lr"], r["seed"], name)] = r["final_val_loss"]
    flush = {(n, lr, seed): v for (s, n, lr, seed, run), v in runs.items() if run == "flush"}
    lines = sorted({(s, n, lr) for (s, n, lr, seed, run) in runs if run != "flush"})
    names = sorted({run for *_, run in runs if run != "flush"})
    print("| candidate | S | N | lr | warmup | seeds: final (gap vs flush) | median gap |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        for s, n, lr in lines:
            cells, gaps = [], []
            for seed in (0, 1, 2):
                v = runs.get((s, n, lr, seed, name))
                f = flush.get((n, lr, seed))
                if v is None or f is None:
                    continue
                gaps.append((v - f) / f)
                cells.append(f"s{seed} {v:.4f} ({gaps[-1]:+.2%})")
            if cells:
                med = f"{statistics.median(gaps):+.2%}" if len(gaps) == 3 else "-"
                print(f"| {name} | {s} | {n} | {lr:g} | 1% | " + "; ".join(cells) + f" | {med} |")
    print()
    print("flush:", "; ".join(f"N={n} lr={lr:g} s{seed}: {v:.4f}" for (n, lr, seed), v in sorted(flush.items())))
    print()
    for name, rule in (("paci_default", "share"), ("paci_default", "whole"), ("paci_default_compiled", "whole")):
        print(f"{name}, {'the default' if rule == 'share' else 'the previous rule (whole fold)'}:")
        print(time_to_accuracy_table(name, rule))
        print()
    label = {"share": "the default", "whole": "the previous rule (whole fold)"}
    for rule in ("share", "whole"):
        print(f"{label[rule]}:\n{ideal_throughput_table(rule)}\n")
    for rule in ("share", "whole") if PAPER_COSTS.exists() else ():
        print(f"{label[rule]}:\n{long_lines_table(rule)}\n")
    print(f"the long lines' noise floor, {label['share']}:\n{noise_floor_table()}\n")
    for path in (PAPER_COSTS, _paper_costs_file("cuda")):
        for rule in ("share", "whole") if path.exists() else ():
            print(f"{label[rule]}:\n{paper_shape_table(path, rule)}\n")
    print("wrote", plot_curves())


def _grid_runs(rule: str = "share") -> tuple[dict[tuple, dict], dict[str, list[float]] | None]:
    """The grid-length runs of every exp31 file by (S, N, lr, seed, run) (flush under S=8: it does not depend on S;
    the default's runs of ``rule``), and the per-layer costs of the first file of PACI's defaults."""
    runs, costs = {}, None
    for _, payload in _payloads(rule):
        for r in payload.get("runs") or []:
            if r["steps"] * r["N"] == GRID_STEPS:
                runs[(8 if r["run"] == "flush" else r["S"], r["N"], r["lr"], r["seed"], r["run"])] = r
                if r["run"] == "paci_default":
                    costs = costs or payload.get("layer_costs")
    return runs, _costs(costs)


def plot_curves(seed: int = 0) -> Path:
    """S=8 N=8, one column per learning rate: validation loss of flush, plain PACI and PACI's defaults against
    training tokens (top) and against simulated time (bottom: steps x each schedule's simulated step time, a
    synchronous start's steps at flush's)."""
    from benchmarks.harness import PLOTS, pyplot, save_figure
    from benchmarks.paci_at_depth import paci_seconds, prediction_cost, simulated_step_seconds

    runs, costs = _grid_runs()
    plain = simulated_step_seconds(costs, 8, 8) if costs else {"1f1b_flush": 1.0, "paci": 1.0}
    plt = pyplot()
    lrs = (5e-4, 1e-3, 2e-3)
    fig, axes = plt.subplots(2, len(lrs), figsize=(4.4 * len(lrs), 6.4), squeeze=False)
    for col, lr in enumerate(lrs):
        runs_drawn = (("flush", "k-"), ("paci", "r--"), ("paci_default", "b-"), ("paci_default_compiled", "g:"))
        for name, style in runs_drawn:
            r = runs.get((8, 8, lr, seed, name))
            if r is None:
                continue
            steps, losses = zip(*r["val"][1:], strict=True)
            sync = r.get("sync_start_steps", 0)
            key = prediction_cost(name)
            per_step = simulated_step_seconds(costs, 8, 8, key) if costs and key in costs else plain
            pace = per_step["1f1b_flush"] if name == "flush" else per_step["paci"]
            seconds = [
                pace * s if name == "flush" else paci_seconds(s, sync, per_step["1f1b_flush"], pace) for s in steps
            ]
            label = {
                "paci": "plain PACI", "paci_default": "PACI's defaults",
                "paci_default_compiled": "the defaults, prediction compiled (CUDA's)",
            }.get(name, name)  # fmt: skip
            axes[0][col].plot([s * r["tokens_per_step"] / 1e3 for s in steps], losses, style, marker=".", label=label)
            axes[1][col].plot(seconds, losses, style, marker=".", label=label)
        axes[0][col].set_title(f"S=8, N=8, lr={lr:g}, seed {seed}", fontsize=9)
        axes[0][col].set_xlabel("training tokens (thousands)")
        axes[1][col].set_xlabel("simulated time (s, from measured per-layer costs)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_ylabel("validation loss")
            ax.set_ylim(top=3.6)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("PACI at S=8: flush, plain PACI and PACI's defaults (benchmarks/exp31_table.py)", fontsize=9)
    path = PLOTS / "exp31_default_curves.png"
    save_figure(fig, path, 100)
    return path


def time_to_accuracy_table(name: str, rule: str = "share") -> str:
    """Simulated time to flush's targets at S=8 for run ``name`` (`paci_at_depth.time_to_accuracy`: the layer costs
    measured with the run's file, a synchronous start's steps at flush's pace), against flush's runs of any file
    (flush does not depend on S); a default's runs of ``rule`` (`_payloads`)."""
    from benchmarks.paci_at_depth import time_to_accuracy

    found, flush, costs = {}, {}, None
    for _, payload in _payloads(rule):
        for r in payload.get("runs") or []:
            if r["steps"] * r["N"] != GRID_STEPS:
                continue
            if r["run"] == "flush":
                flush[(r["N"], r["lr"], r["seed"])] = r
            elif r["run"] == name and r["S"] == 8:
                found[(r["N"], r["lr"], r["seed"])] = r
                costs = costs or payload.get("layer_costs")
    runs = list(found.values())
    costs = _costs(costs)
    rows = time_to_accuracy(runs + [{**flush[(r["N"], r["lr"], r["seed"])], "S": 8} for r in runs], costs or {})
    header = "| S | N | lr | seed | run | throughput | to 80% | to 95% | to final | to both's lowest |"
    lines = [header, "|" + "---|" * 10]
    for r in rows:
        keys = ("80%", "95%", "final", "both")
        cells = [f"{r[k]['ratio']:.2f}" if r[k]["ratio"] == r[k]["ratio"] else "never" for k in keys]
        lines.append(f"| 8 | {r['N']} | {r['lr']:g} | {r['seed']} | {r['run']} | {r['throughput_ratio']:.2f} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    costed = all(r["prediction_costed"] for r in rows)
    lines.append(f"(the prediction's apply + undo {'included in' if costed else 'NOT included in'} PACI's step time)")
    return "\n".join(lines)


def _val_tokens(config: dict) -> int:
    """The tokens of one validation along a run's curve (its sample: two runs compare on the same one)."""
    return config.get("val_batches", 8) * config.get("batch_size", 8) * config.get("block", 32)


def _default_pairs(rule: str = "share") -> list[tuple]:
    """Every S=8 run of PACI's defaults (of ``rule``, `_payloads`) with its flush run (same N, model depth, steps,
    lr, seed and tokens per step), as (N, layers, steps, lr, seed, flush, PACI) in table order; of the eager and the
    compiled form (equal to 4 decimals) the first file's. The flush run of PACI's own file where it has one (its curve
    validated on the same batches: an earlier file's flush of the same key may have validated on fewer), else the
    first file's. Two lines that differ only in sequence length or micro-batch are two pairs, never one."""
    flush, own, found = {}, {}, {}
    for path, payload in _payloads(rule):
        config = payload.get("config", {})
        tokens = config.get("batch_size", 8) * config.get("block", 32)  # per micro-batch, as the grid's defaults
        for r in payload.get("runs") or []:
            key = (
                r["N"],
                config.get("layers", 6),
                r["steps"],
                r["lr"],
                r["seed"],
                r.get("tokens_per_step", tokens * r["N"]),
            )
            r = {**r, "val_tokens": _val_tokens(config)}
            if r["run"] == "flush":
                flush.setdefault(key, r)
                own[(path, key)] = r
            elif r["run"] in DEFAULTS and r["S"] == 8 and key not in found:
                found[key] = (path, r)
    pairs = {k: (own.get((path, k), flush.get(k)), r) for k, (path, r) in found.items()}
    order = sorted(
        (k for k, (f, _) in pairs.items() if f is not None), key=lambda k: (k[1], k[2], k[0], -k[3], k[4], k[5])
    )
    return [(*k[:5], *pairs[k]) for k in order]


def ideal_throughput_table(rule: str = "share") -> str:
    """What the curves alone allow: per S=8 run of PACI's defaults (the grid's and the longer lines'), the optimizer
    steps flush and PACI take to the lowest loss both reach (the paper's target), and the simulated time ratio at
    the schedule's ideal throughput over flush, (N + S - 1) / N: balanced stages and a free prediction, the best
    any partition or device could give; the synchronous start's steps at flush's pace."""
    from benchmarks.paci_at_depth import lowest_both_reach, paci_seconds, steps_to

    lines = [
        "| layers | steps | N | lr | seed | flush's steps to both's lowest | PACI's | at the ideal throughput |",
        "|" + "---|" * 8,
    ]
    for n, layers, steps, lr, seed, f, r in _default_pairs(rule):
        both = lowest_both_reach(f["val"], r["val"])
        to_flush, to_paci, sync = steps_to(f["val"], both), steps_to(r["val"], both), r.get("sync_start_steps", 0)
        ratio = to_flush / paci_seconds(to_paci, sync, 1.0, n / (n + 8 - 1))  # flush's step 1, PACI's the ideal
        lines.append(f"| {layers} | {steps} | {n} | {lr:g} | {seed} | {to_flush:.0f} | {to_paci:.0f} | {ratio:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
