"""Backend choice: which of libaio, the raw kernel calls or threads runs here.

Job: ``probe_backend`` checks that a named backend can run (a kernel context is created
and destroyed: seccomp or a kernel without AIO fails there) and ``resolve_backend`` turns
AUTO into the best one available, probed once per process and logged once.

Invariant: an explicitly named backend that cannot run is an error
(:class:`BackendUnavailableError`, saying what to do), never a silent fallback; only AUTO
falls back, with the reason logged.
"""

from __future__ import annotations

import logging
import sys
import threading

from tiers.aio._native import KernelAio, LibAio, _Provider
from tiers.config import Backend
from tiers.errors import BackendUnavailableError

log = logging.getLogger("swapper.tiers.aio")


# ----------------------------------------------------------------------------------------
# Backend choice


_auto_choice: tuple[Backend, str] | None = None
_auto_resolved: dict[tuple[type, type], tuple[Backend, _Provider | None, str]] = {}
_auto_lock = threading.Lock()


def _probe(provider_cls: type[_Provider]) -> _Provider:
    provider = provider_cls()
    provider.destroy(provider.setup(1))  # seccomp or a kernel without AIO fails here
    return provider


def probe_backend(backend: Backend) -> tuple[_Provider | None, str]:
    """Check that ``backend`` can run here; returns its provider (None for threads) and why.

    Raises:
        BackendUnavailableError: it cannot; the message says why and what to do.
    """
    if backend is Backend.THREADS:
        return None, "asked for"
    if sys.platform != "linux":
        raise BackendUnavailableError(f"backend {backend.value!r} needs Linux; use 'threads'")
    hints = {
        Backend.LIBAIO: "install libaio (Debian/Ubuntu: apt-get install libaio1), or use "
        "backend 'kernel' or 'threads'",
        Backend.KERNEL: "kernel AIO is blocked or missing here (seccomp, gVisor, "
        "fs.aio-max-nr); use backend 'threads'",
    }
    cls = LibAio if backend is Backend.LIBAIO else KernelAio
    try:
        return _probe(cls), "available"
    except OSError as exc:
        raise BackendUnavailableError(
            f"backend {backend.value!r} unavailable: {exc}; {hints[backend]}"
        ) from exc


def resolve_backend(backend: Backend) -> tuple[Backend, _Provider | None]:
    """Resolve AUTO to the best backend available; log the choice once per process.

    The AUTO probe (creating and destroying a kernel context, ~30 ms) runs once per
    process: the machine's answer does not change while it runs.

    Raises:
        BackendUnavailableError: an explicitly named backend cannot run here.
    """
    if backend is not Backend.AUTO:
        return backend, probe_backend(backend)[0]
    key = (LibAio, KernelAio)  # tests swap these to simulate machines without them
    with _auto_lock:
        cached = _auto_resolved.get(key)
    if cached is None:
        cached = _probe_auto()
        with _auto_lock:
            _auto_resolved[key] = cached
    chosen, provider, why = cached
    _log_auto(chosen, why)
    return chosen, provider


def _probe_auto() -> tuple[Backend, _Provider | None, str]:
    reasons = []
    for candidate in (Backend.LIBAIO, Backend.KERNEL):
        try:
            provider, _ = probe_backend(candidate)
        except BackendUnavailableError as exc:
            reasons.append(str(exc.__cause__ or exc))
            continue
        why = "native Linux AIO" + (f" ({'; '.join(reasons)})" if reasons else "")
        return candidate, provider, why
    return Backend.THREADS, None, "; ".join(reasons)


def _log_auto(backend: Backend, why: str) -> None:
    global _auto_choice
    with _auto_lock:
        if _auto_choice == (backend, why):
            return
        _auto_choice = (backend, why)
    level = logging.INFO if backend is not Backend.THREADS else logging.WARNING
    log.log(level, "aio backend auto -> %s: %s", backend.value, why)
