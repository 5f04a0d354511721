"""``python -m swapper.bench``: the same as the ``swapper-bench`` command."""

from swapper.console import bench

bench()
