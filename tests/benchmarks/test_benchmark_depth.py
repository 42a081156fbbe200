"""benchmarks/paci_at_depth.py --quick runs end to end and writes the JSON the report is built from."""

from __future__ import annotations

import json

from benchmarks import paci_at_depth


def test_quick_run_writes_every_section(tmp_path):
    out, png = tmp_path / "depth.json", tmp_path / "depth.png"
    paci_at_depth.main(["--quick", "--out", str(out), "--plot", str(png)])
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
