"""``python -m tl_attnonly.cli``: the ``tl-attnonly`` command (as ``torchrun -m`` runs it)."""

from tl_attnonly.cli import main

raise SystemExit(main())
