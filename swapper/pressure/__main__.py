"""``python -m swapper.pressure``: the same as the ``swapper-pressure`` command."""

from swapper.console import pressure

pressure()
