"""``python -m swapper.bench``: the same as the ``swapper-bench`` command."""

import sys

from swapper.bench import main

sys.exit(main())
