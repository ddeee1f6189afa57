"""``python -m autotune.cli``: the same entry point as the ``autotune`` script."""
import sys

from autotune.cli.main import main

sys.exit(main())
