"""``python -m mcore.train``: the ``mcore-train`` command (what ``torchrun ... -m mcore.train`` runs per rank)."""

import sys

from mcore.train.cli import main

sys.exit(main())
