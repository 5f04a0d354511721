"""Shared fixtures of the tiers tests: which AIO backends run here, swap directories, mounts.

* ``backend``: any test that takes an argument named ``backend`` is parametrized over
  every :class:`~tiers.config.Backend` except AUTO; those that cannot run on this machine
  are skipped with the reason (``probe_backend``'s message).
* ``swap_dir``: a fresh private (0700) directory under pytest's ``tmp_path``.
* ``mount_tmpfs``: mounts a small tmpfs under ``tmp_path`` (root only) and always
  unmounts it at teardown; returns None where mounting is impossible so a test can fall
  back to fault injection.
* ``remount_readonly``: makes such a mount read-only (works for root too).
* hypothesis's storage (example database, patches) goes under pytest's basetemp; its
  per-example deadline is off (profile ``swapper``): CI shares two cores with other work, and
  speed is measured by benchmarks, not by a test's timer.
* ``fd_count``: how many descriptors this process has open (``/proc/self/fd``).
"""

from __future__ import annotations

import gc
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

from tiers.aio import probe_backend
from tiers.config import Backend
from tiers.errors import BackendUnavailableError

settings.register_profile("swapper", deadline=None)
settings.load_profile("swapper")


def _probe_all() -> dict[Backend, str | None]:
    """Backend → None when it runs here, else why not."""
    out: dict[Backend, str | None] = {}
    for backend in (Backend.LIBAIO, Backend.KERNEL, Backend.THREADS):
        try:
            probe_backend(backend)
        except BackendUnavailableError as exc:
            out[backend] = str(exc)
        else:
            out[backend] = None
    return out


#: Backend → None if usable here, else the reason it is not.
BACKEND_STATUS = _probe_all()
#: The backends that run on this machine, fastest first.
AVAILABLE_BACKENDS = [b for b, why in BACKEND_STATUS.items() if why is None]


def backend_params() -> list[object]:
    """pytest params over LIBAIO, KERNEL, THREADS; the unusable ones skip with the reason."""
    return [
        pytest.param(
            b,
            id=b.value,
            marks=pytest.mark.skipif(why is not None, reason=f"{b.value}: {why}"),
        )
        for b, why in BACKEND_STATUS.items()
    ]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames and not _already_parametrized(metafunc, "backend"):
        metafunc.parametrize("backend", backend_params())


def _already_parametrized(metafunc: pytest.Metafunc, name: str) -> bool:
    return any(name in mark.args[0] for mark in metafunc.definition.iter_markers("parametrize"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` where CUDA is not available (as pyproject's marker says)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; torch.cuda.is_available() is false")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """Hypothesis keeps its example database, constants cache and patches under pytest's
    basetemp, not in a ``.hypothesis/`` of the working tree (its plugin writes there as
    early as collection, hence here and not in a fixture)."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is not None and not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        set_hypothesis_home_dir(factory.mktemp("hypothesis"))


@pytest.fixture
def available_backends() -> list[Backend]:
    return list(AVAILABLE_BACKENDS)


@pytest.fixture
def swap_dir(tmp_path: Path) -> Path:
    d = tmp_path / "swap"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def fd_count() -> Callable[[], int]:
    def count() -> int:
        gc.collect()
        return len(os.listdir("/proc/self/fd"))

    return count


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path | None]]:
    """``mount_tmpfs(name, size="1m")`` → the mount point, or None where mount fails.

    Every mount is undone at teardown (lazily if a descriptor still holds it).
    """
    mounted: list[Path] = []

    def mount(name: str, size: str = "1m") -> Path | None:
        if os.geteuid() != 0:
            return None
        target = tmp_path / name
        target.mkdir()
        res = _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(target))
        if res.returncode != 0:
            return None
        mounted.append(target)
        return target

    try:
        yield mount
    finally:
        for target in reversed(mounted):
            if _run("umount", str(target)).returncode != 0:
                _run("umount", "-l", str(target))


@pytest.fixture
def remount_readonly() -> Callable[[Path], bool]:
    """``remount_readonly(mount_point)``: make a ``mount_tmpfs`` mount read-only (False: failed)."""

    def remount(target: Path) -> bool:
        return _run("mount", "-o", "remount,ro", str(target)).returncode == 0

    return remount
