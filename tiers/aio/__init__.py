"""Asynchronous file I/O: native Linux AIO (libaio or raw syscalls) or a thread pool."""

from tiers.aio.engine import AioEngine, IOFuture, Op, probe_backend, resolve_backend

__all__ = ["AioEngine", "IOFuture", "Op", "probe_backend", "resolve_backend"]
