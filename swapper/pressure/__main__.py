"""``python -m swapper.pressure``: the same as the ``swapper-pressure`` command."""

import sys

from swapper.pressure.cli import main

sys.exit(main())
