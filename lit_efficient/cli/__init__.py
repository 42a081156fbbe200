"""The ``lit-efficient`` command: ``fit``/``validate``/``test``/``predict`` (LightningCLI, `app`) and ``plan``
(the memory plan of a config, `plan`, which trains nothing).

    lit-efficient fit --config configs/quickstart.yaml
    python -m lit_efficient.cli fit ...                       # the same, e.g. under srun or torchrun -m
    lit-efficient plan --config configs/gpt2_medium_8stage_paci.yaml --device-memory 80GiB
"""

from __future__ import annotations

import sys
from typing import Any


def main(args: Any = None) -> None:
    """Entry point of the ``lit-efficient`` console script and of ``python -m lit_efficient.cli``.

    ``lit-efficient plan ...`` is the memory plan of a config (`lit_efficient.cli.plan`); every other subcommand
    is LightningCLI's (`lit_efficient.cli.app.LitEfficientCLI`).
    """
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, (list, tuple)) and argv and argv[0] == "plan":
        from lit_efficient.cli.plan import main as plan_main  # planning never starts a Trainer

        raise SystemExit(plan_main(list(argv[1:])))
    from lit_efficient.cli.app import LitEfficientCLI

    LitEfficientCLI(args=args)
