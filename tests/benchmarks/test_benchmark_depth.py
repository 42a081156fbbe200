"""benchmarks/paci_at_depth.py --quick runs end to end and writes the JSON the report is built from."""

from __future__ import annotations

import json

import pytest

from benchmarks import paci_at_depth


def test_quick_run_writes_every_section(tmp_path):
    out, png = tmp_path / "depth.json", tmp_path / "depth.png"
    paci_at_depth.main(["--quick", "--final-val-batches", "16", "--out", str(out), "--plot", str(png)])
    result = json.loads(out.read_text())
    assert {"summary", "time_to_accuracy", "in_process_cost", "weight_prediction_cost", "layer_costs", "runs"} <= set(
        result
    )
    assert result["command"] == "python -m benchmarks.paci_at_depth --quick" and png.exists()
    row = result["summary"][0]
    assert {"S", "N", "lr", "seed", "final", "gap"} <= set(row) and set(row["final"]) == {"flush", "paci"}
    run = result["runs"][0]
    assert {"val", "final_val_loss", "drift", "seconds", "tokens_per_step"} <= set(run) and len(run["drift"]) == 4
    assert {"unsplit", "in-process S=4", "ratio", "weight_prediction_ratio"} <= set(result["in_process_cost"])
    assert result["summary"][0]["warmup"] == 0.01
    assert "| 4 | 4 | 0.003 | 1% | 0 |" in paci_at_depth.report([str(out)])  # --report reads the same file
    assert len(result["layer_costs"]["forward"]) == 4  # embed, 2 blocks, head
    # The wide final validation is a separate number: the curve keeps its own batch and ends where it ended.
    for run in result["runs"]:
        assert run["final_val_loss"] == run["val"][-1][1] and run["val"][-1][0] == run["steps"]
        assert len(run["val"]) == 3 and run["final_val_batches"] == 16
        assert run["final_val_loss_wide"] != run["final_val_loss"]  # 16 batches, not the curve's one
    assert set(row["final_wide"]) == {"flush", "paci"} and "paci" in row["gap_wide"]
    assert "The final models on the wider validation" in paci_at_depth.report([str(out)])


def test_time_to_the_lowest_loss_both_reach():
    """The paper's target is the lowest loss both runs reach: PACI's own lowest where it ends above flush (flush's
    final loss is then never reached), flush's final where PACI gets below it."""
    costs = {"forward": [1.0] * 8, "backward": [2.0] * 8}  # balanced: PACI's step (N + S - 1) / N = 15/8 faster
    flush = {"S": 8, "N": 8, "lr": 1e-3, "seed": 0, "run": "flush", "val": [[0, 4.0], [50, 3.0], [100, 2.0]]}
    above = {**flush, "run": "paci", "val": [[0, 4.0], [50, 3.0], [100, 2.5]]}
    below = {**flush, "run": "paci_recompute", "val": [[0, 4.0], [50, 2.0], [100, 1.5]]}
    rows = {r["run"]: r for r in paci_at_depth.time_to_accuracy([flush, above, below], costs)}
    ratio = rows["paci"]["throughput_ratio"]
    assert abs(ratio - 15 / 8) < 1e-9
    assert rows["paci"]["final"]["ratio"] != rows["paci"]["final"]["ratio"]  # NaN: never
    # both reach 2.5: flush at step 75, PACI at its step 100
    assert rows["paci"]["both"]["target"] == 2.5 and abs(rows["paci"]["both"]["ratio"] - 0.75 * ratio) < 1e-9
    # PACI below flush: the target is flush's final loss, reached at flush's step 100 and PACI's step 50
    assert rows["paci_recompute"]["both"]["target"] == 2.0
    assert abs(rows["paci_recompute"]["both"]["ratio"] - 2 * ratio) < 1e-9
    assert rows["paci_recompute"]["both"]["ratio"] == rows["paci_recompute"]["final"]["ratio"]


def test_paper_shape_timing_with_balanced_free_costs_is_the_ideal(tmp_path, monkeypatch):
    """`paper_shape_table` times the committed curves with measured layer costs; with costs whose stages balance
    and whose prediction is free it must give the schedule's ideal throughput and the ideal table's ratios (on the
    previous rule's runs, the most lines; the timing does not depend on the rule)."""
    from benchmarks import exp31_table

    free = {"forward": [1e-9, 1.0, 1e-9], "backward": [1e-9, 2.0, 1e-9], "predict": [0.0] * 3}
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"layer_costs": {**free, "predict_compiled": [0.0] * 3}}))
    monkeypatch.setattr(exp31_table, "PAPER_COSTS", costs)
    table = exp31_table.paper_shape_table(rule="whole")
    assert "split [4, 3, 3, 3, 3, 3, 3, 4]" in table  # the embedding and the head weigh nothing here
    ideal = {}
    for line in exp31_table.ideal_throughput_table("whole").splitlines()[2:]:
        layers, steps, n, lr, seed, *_, ratio = (c.strip() for c in line.strip("|").split("|"))
        if n == "8":
            ideal[(layers, steps, lr, seed)] = ratio
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[4:]]
    assert len(rows) >= 9 and all(ideal[tuple(r[:4])] == r[4] == r[5] for r in rows)
    # The long lines' table times the issue's own target (flush's final loss) with the same costs: here the ideal.
    long_table = exp31_table.long_lines_table("whole")
    long_rows = [[c.strip() for c in line.strip("|").split("|")] for line in long_table.splitlines()[2:]]
    assert len(long_rows) >= 8 and all(r[-3] == r[-2] for r in long_rows)
    reached = [r for r in long_rows if r[-2] != "never"]
    assert reached and all(float(r[-2]) > 1.0 for r in reached)  # PACI reaches flush's final: faster at the ideal
    # Where the whole split puts PACI's final model at or below flush's, the bound is all of PACI's steps at the
    # ideal, its synchronous start at flush's pace: 2,400 / (40 + 2,360 x 8 / 15) = 1.848 at 2,400 steps.
    bounded = [r for r in long_rows if r[-1].startswith(">=")]
    assert bounded and all(r[-1] == ">= 1.848" for r in bounded if r[1] == "2400")


def test_paper_shape_on_cuda_times_the_kernels_and_the_stage(tmp_path, monkeypatch, capsys):
    """A GPU's costs file (`measure_paper_shape` on CUDA) carries the prediction's kernels alone and a stage's window:
    the table prints both, times the curves with each form, and the long lines' table gains the GPU's column. With a
    free prediction the kernel columns are the ideal's; the stage line's per-block cost is (form - plain) / blocks."""
    from benchmarks import exp31_table

    free = {"forward": [1e-9, 1.0, 1e-9], "backward": [1e-9, 2.0, 1e-9]}
    cpu = {**free, "predict": [0.0] * 3, "predict_compiled": [0.0] * 3}
    gpu = {**cpu, "predict": [1.0] * 3, "predict_compiled": [0.5] * 3, "predict_gpu": [0.0] * 3}
    stage = {"blocks": 4, "micro_batches": 8, "rounds": 7, "none": 0.010, "eager": 0.018, "compiled": 0.0108}
    monkeypatch.setattr(exp31_table, "PAPER_COSTS", tmp_path / "costs.json")
    (tmp_path / "costs.json").write_text(json.dumps({"layer_costs": cpu}))
    path = tmp_path / "costs_cuda.json"
    path.write_text(json.dumps({"layer_costs": {**gpu, "predict_compiled_gpu": [0.0] * 3}, "gpu": "a GPU",
                                "stage_costs": stage}))  # fmt: skip
    assert exp31_table._paper_costs_file("cuda") == path
    table = exp31_table.paper_shape_table(path, rule="whole")
    assert "paper's shape, a GPU:" in table
    assert "kernels alone (the host ahead): a block's eager / compiled 0.00 / 0.00 ms" in table
    assert "the prediction adds 2.00 / 0.20 ms per block (eager / compiled)" in table
    header = next(line for line in table.splitlines() if line.startswith("| layers"))
    assert header.endswith("reach, eager | compiled | eager, kernels alone | compiled, kernels alone |")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line[:4] == "| 6 "]
    # between synchronizations the prediction costs a third and a sixth of a block: slower than the free kernels
    assert rows and all(float(r[4]) < float(r[5]) < float(r[6]) == float(r[7]) for r in rows)
    # The command line prints the same table from the file, and says what to run where there is none.
    monkeypatch.setattr("sys.argv", ["exp31_table", "--paper-shape", "--device", "cuda"])
    exp31_table.main()
    assert "kernels alone (the host ahead)" in capsys.readouterr().out
    monkeypatch.setattr(exp31_table, "PAPER_COSTS", tmp_path / "elsewhere" / "costs.json")
    with pytest.raises(SystemExit, match="measure them with --measure-paper-shape --device cuda"):
        exp31_table.main()
    monkeypatch.setattr(exp31_table, "PAPER_COSTS", tmp_path / "costs.json")
    long_table = exp31_table.long_lines_table("whole")
    assert "| H200 | ideal | whole split: at least |" in long_table.splitlines()[0]
    long_rows = [[c.strip() for c in line.strip("|").split("|")] for line in long_table.splitlines()[2:]]
    assert all(r[-3] == r[-2] for r in long_rows)  # free kernels, balanced stages: the GPU's column is the ideal


def test_final_val_batches_below_minus_one_is_refused_by_name(capsys):
    """-1 is the whole split and 0 none; a lower value is a typo, not a silent whole-split validation."""
    import pytest

    with pytest.raises(SystemExit):
        paci_at_depth.parse_args(["--final-val-batches", "-3"])
    assert "--final-val-batches -3" in capsys.readouterr().err
    assert paci_at_depth.parse_args(["--final-val-batches", "-1"]).final_val_batches == -1


def test_a_default_run_pairs_with_the_flush_run_of_its_own_file(tmp_path, monkeypatch):
    """A later pair of the same line (flush and the default, validated on more batches) must not be compared with an
    earlier file's flush of the same key (validated on fewer): the default's own file's flush first."""
    from benchmarks import exp31_table

    def run(name: str, final: float) -> dict:
        return {"run": name, "S": 8, "N": 8, "lr": 2e-3, "seed": 0, "steps": 2400, "val": [[2400, final]]}

    earlier = {"config": {"layers": 14, "val_batches": 8}, "runs": [run("flush", 1.90)]}
    later = {"config": {"layers": 14, "val_batches": 64}, "runs": [run("flush", 1.80), run("paci_default", 1.81)]}
    only_default = {"config": {"layers": 6, "val_batches": 8}, "runs": [run("paci_default", 2.5)]}
    grid_flush = {"config": {"layers": 6, "val_batches": 8}, "runs": [run("flush", 2.4)]}
    # the same line but 64-token sequences (its own flush, and one only of the default): two pairs, not one
    longer = {
        "config": {"layers": 14, "val_batches": 64, "block": 64},
        "runs": [run("flush", 1.70), run("paci_default", 1.72)],
    }
    only_longer = {"config": {"layers": 6, "val_batches": 8, "block": 64}, "runs": [run("paci_default", 2.6)]}
    files = [("exp31_a", earlier), ("exp31_b", later), ("exp31_c", grid_flush), ("exp31_d", only_default),
             ("exp31_e", longer), ("exp31_f", only_longer)]  # fmt: skip
    for name, payload in files:
        (tmp_path / f"{name}.json").write_text(json.dumps(payload))
    monkeypatch.setattr(exp31_table, "RESULTS", tmp_path)
    pairs = {(layers, f["val"][-1][1]): r["val"][-1][1] for _, layers, _, _, _, f, r in exp31_table._default_pairs()}
    # its own file's flush; else the line's flush from any file; never a flush of another sequence length (the
    # 64-token default of 6 layers has none: it is left out, not paired with the 32-token flush)
    assert pairs == {(14, 1.80): 1.81, (14, 1.70): 1.72, (6, 2.4): 2.5}


def test_exp31_table_refuses_a_misspelled_option_by_name(capsys):
    """The table script's options: a misspelling used to fall through to the default tables, silently."""
    from benchmarks import exp31_table

    for argv, said in [
        (["--paper_shape"], "unrecognized arguments: --paper_shape"),
        (["--device", "cuda"], "--device cuda applies to --measure-paper-shape and --paper-shape only"),
        (["--paper-shape", "--device", "tpu"], "invalid choice: 'tpu'"),
        (["--measure-costs", "--by-size"], "not allowed with argument --measure-costs"),
    ]:
        with pytest.raises(SystemExit):
            exp31_table.parse_args(argv)
        assert said in capsys.readouterr().err
    assert exp31_table.parse_args(["--paper-shape", "--device", "cuda"]).device == "cuda"


def test_the_noise_floor_table_pairs_each_perturbed_run_with_its_seeds_flush(tmp_path, monkeypatch):
    """The long lines' noise floor: a perturbed flush run is compared with the same (lr, seed)'s flush of the same
    line (2,400 steps, 14 layers, N=8, the same tokens per step and validation sample), on the curve and on the whole
    split, and the summary counts the runs above flush; runs of other lines are left out, never paired."""
    from benchmarks import exp31_table

    def run(name: str, seed: int, final: float, wide: float, steps: int = 2400, tokens: int = 256) -> dict:
        return {"run": name, "S": 8, "N": 8, "lr": 2e-3, "seed": seed, "steps": steps, "val": [[steps, final]],
                "final_val_loss_wide": wide, "tokens_per_step": 8 * tokens}  # fmt: skip

    line = {"config": {"layers": 14, "val_batches": 64}}
    pairs = {**line, "runs": [run("flush", 0, 2.0, 1.8), run("paci_default", 0, 2.02, 1.8), run("flush", 1, 2.0, 1.9),
                              run("paci_default", 1, 1.98, 1.881)]}  # fmt: skip
    (tmp_path / "exp31_long.json").write_text(json.dumps(pairs))
    # other lines at the same (lr, seed): a 600-step pair (not the deep line: its losses must not show) and a
    # 64-token pair of the deep line (a pair of its own: a row of PACI's, no perturbed run is compared with it)
    short = {**line, "runs": [run("flush", 0, 3.0, 3.0, steps=600), run("paci_default", 0, 3.3, 3.3, steps=600)]}
    wide_block = {"config": {"layers": 14, "val_batches": 64, "block": 64}, "runs": [
        run("flush", 0, 4.0, 4.0, tokens=512), run("paci_default", 0, 4.4, 4.4, tokens=512)]}  # fmt: skip
    (tmp_path / "exp31_long_short.json").write_text(json.dumps(short))
    (tmp_path / "exp31_long_block64.json").write_text(json.dumps(wide_block))
    options = "--layers 14 --val-batches 64"
    perturbed = [
        ("noise1", options, 1, run("flush", 0, 2.02, 1.818)),
        ("noise2", options, 2, run("flush", 0, 1.99, 1.782)),
        ("sample8", "--layers 14", 3, run("flush", 0, 5.0, 5.0)),  # validated on 8 batches: another sample
        ("lr5e-4", options, 4, {**run("flush", 0, 3.0, 3.0), "lr": 5e-4}),  # no flush of that lr
    ]
    for name, opts, noise, result in perturbed:
        payload = {"args": {"noise_seed": noise, "line_options": opts}, "result": result}
        (tmp_path / f"exp31_perturb_long14_{name}.json").write_text(json.dumps(payload))
    monkeypatch.setattr(exp31_table, "RESULTS", tmp_path)
    table = exp31_table.noise_floor_table()
    rows, summary = table.split("\n\n")
    assert rows.splitlines()[2:] == [
        "| perturbed flush | 0.002 | 0 noise 1 | +1.00% | +1.00% |",
        "| perturbed flush | 0.002 | 0 noise 2 | -0.50% | -1.00% |",
        "| PACI's defaults | 0.002 | 0 | +1.00% | +0.00% |",
        "| PACI's defaults | 0.002 | 0 | +10.00% | +10.00% |",
        "| PACI's defaults | 0.002 | 1 | -1.00% | -1.00% |",
    ]
    assert (
        "| PACI's defaults | 0.002 | 3 | +1.00% (-1.00% to +10.00%), 2 of 3 | +0.00% (-1.00% to +10.00%), 1 of 3 |"
    ) in summary
    assert (
        "| perturbed flush | 0.002 | 2 | +0.25% (-0.50% to +1.00%), 1 of 2 | +0.00% (-1.00% to +1.00%), 1 of 2 |"
    ) in summary
