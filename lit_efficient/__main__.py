"""``python -m lit_efficient``: the ``lit-efficient`` command, as ``python -m lit_efficient.cli`` runs it."""

from lit_efficient.cli import main

main()
