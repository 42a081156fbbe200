"""The example scripts import cleanly, guard their work behind ``__main__``, and the cheap ones run."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.support.examples import EXAMPLES
from tests.support.examples import load_example as _load

SCRIPTS = sorted(EXAMPLES.glob("*.py"))


def test_the_documented_examples_exist():
    names = {p.stem for p in SCRIPTS}
    assert {"train_gpt_paci", "compare_schedules", "localsgd_data_parallel", "checkpointing_memory"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_example_imports_without_running_and_has_a_main_guard(path):
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree)
    assert doc and f"examples/{path.name}" in doc, "the docstring says how to run it"
    assert "measured" in doc.lower() or "about" in doc, "the docstring says how long it runs"
    # Launchers re-run or re-import the script per rank: nothing may train at import time.
    guard = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert guard, "needs `if __name__ == '__main__':`"
    module = _load(path)
    assert callable(module.main)


def test_draw_schedules_writes_the_picture(tmp_path, monkeypatch):
    args = ["--stages", "3", "--accumulate", "2", "--out", str(tmp_path / "s.png")]
    out = _load(EXAMPLES / "draw_schedules.py").main(args)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # By default where it is run, not into the package's folder (it wrote the repository's docs picture from
    # anywhere, an examples audit).
    monkeypatch.chdir(tmp_path)
    assert _load(EXAMPLES / "draw_schedules.py").main(["--windows", "1"]) == Path("schedules.png")
    assert (tmp_path / "schedules.png").is_file()


def test_checkpointing_memory_saves_activation_memory(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["checkpointing_memory.py"])
    tiny = ["--n-layer", "2", "--n-embd", "32", "--block-size", "64", "--batch-size", "2", "--steps", "2"]
    results = _load(EXAMPLES / "checkpointing_memory.py").main(tiny)
    off, full, selective = (results[mode][0] for mode in ("off", "full", "selective"))
    assert 0 < full < selective < off


@pytest.mark.multiproc
@pytest.mark.command
def test_own_hf_model_example_is_a_users_day_from_a_folder_to_save_pretrained(tmp_path, demo_model):
    """examples/own_hf_model.py as docs/hf-on-n-gpus.md runs it (two processes, PACI, its own tokenizer's data):
    the folder it saves reloads with from_pretrained, holds the checkpoint's weights, and answers the validation
    it printed on one device."""
    import os
    import re
    import subprocess

    import lightning as L
    import torch

    from lit_efficient import consolidate_checkpoint
    from lit_efficient.data import TokenizedDataModule
    from lit_efficient.models import HFCausalLM

    env = dict(os.environ, LIT_EFFICIENT_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    args = ["--model", str(demo_model), "--max-steps", "4", "--checkpoint-every", "2", "--max-bytes", "300000",
            "--block-size", "32", "--batch-size", "4"]  # fmt: skip
    done = subprocess.run([sys.executable, str(EXAMPLES / "own_hf_model.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    printed = float(re.search(r"step 4: val_loss ([\d.]+); saved to trained", done.stdout).group(1))
    trained = HFCausalLM(str(tmp_path / "trained"))  # from_pretrained underneath
    saved = consolidate_checkpoint(tmp_path / "runs" / "own_hf_model" / "last.ckpt")
    assert all(torch.equal(saved[k], v) for k, v in trained.state_dict().items())
    data = TokenizedDataModule(str(tmp_path / "trained"), block_size=32, batch_size=4, max_bytes=300_000,
                               cache_dir=str(tmp_path / "cache"))  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, limit_val_batches=8,
                        enable_model_summary=False)  # fmt: skip
    want = trainer.validate(trained, datamodule=data, verbose=False)[0]["val_loss"]
    assert abs(printed - want) < 1e-5, (printed, want)
