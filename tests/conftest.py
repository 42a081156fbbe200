"""Test-session setup.

Multi-process tests start their ranks with ``forkserver`` (tests/multiproc.py's START_METHOD, and
``PACIStrategy(start_method="forkserver")``): the server imports these once and every rank is forked
from it, instead of each spawned rank importing torch and Lightning afresh (about 13 s of CPU per rank
on these machines, most of a multi-process test's time). Set here, before any server starts, with no
import of Lightning: importing it before pytest's log capture is installed would turn off the
propagation of Lightning's log records that tests read through ``caplog``.
"""

import multiprocessing

multiprocessing.set_forkserver_preload(["torch", "lightning.pytorch", "lit_efficient.strategies", "lit_efficient.cli"])
