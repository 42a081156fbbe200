"""``python -m lit_efficient.cli``: the ``lit-efficient`` command (under srun, ``torchrun -m``, ...)."""

from lit_efficient.cli import main

main()
