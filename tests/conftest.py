"""Test-session setup.

Multi-process tests start their ranks with ``forkserver`` (tests/support/multiproc.py's START_METHOD, and
``PACIStrategy(start_method="forkserver")``): the server imports these once and every rank is forked
from it, instead of each spawned rank importing torch and Lightning afresh (about 13 s of CPU per rank
on these machines, most of a multi-process test's time). Set here, before any server starts, with no
import of Lightning: importing it before pytest's log capture is installed would turn off the
propagation of Lightning's log records that tests read through ``caplog``.
"""

import multiprocessing

multiprocessing.set_forkserver_preload(
    ["torch", "lightning.pytorch", "lit_efficient.strategy", "lit_efficient.cli.app"]
)


import os  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """One thread here and in every rank (``pytestmark = pytest.mark.usefixtures("one_thread")``): one device,
    one process and S processes then agree bit for bit under 1F1B-flush (a matmul's reduction order depends
    on the thread count). The ranks read OMP_NUM_THREADS (PACIStrategy's forkserver launcher applies it);
    without it they keep the thread count of the forkserver, which depends on which test started it."""
    import torch

    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """examples/own_hf_model.py's stand-in for a downloaded model: a small Qwen2 and its BPE tokenizer in one
    save_pretrained folder (a 300-token vocabulary trained on 300 kB of the embedded corpus here)."""
    pytest.importorskip("transformers")
    from tests.support.examples import own_hf_model

    return own_hf_model().make_demo_folder(tmp_path_factory.mktemp("my_model"), vocab_size=300, text_bytes=300_000)
