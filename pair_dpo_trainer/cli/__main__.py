"""``python -m pair_dpo_trainer.cli``: the ``pair-dpo`` command."""

import sys

from pair_dpo_trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
