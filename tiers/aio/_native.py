"""Thin mirror of the Linux AIO C API, through cffi in ABI mode (no compiler, no headers).

Two providers of the same four calls:

* :class:`LibAio` calls ``libaio.so.1``. libaio's calls return ``-errno`` on failure.
* :class:`KernelAio` calls the kernel entry points through libc's ``syscall()``, for
  machines without the libaio package. ``syscall()`` returns -1 and sets ``errno``.

Both use the kernel's own ``struct iocb`` / ``struct io_event`` layout (linux/aio_abi.h):
libaio hands its iocbs to the kernel unchanged, so one declaration serves both. Every
failure becomes ``OSError(errno, "<call name>: <strerror>")``; nothing here retries,
allocates per request or knows about files, which is the engine's job.

cffi releases the GIL around every foreign call, so a thread blocked in
``io_getevents`` does not hold up Python.
"""

from __future__ import annotations

import errno as errno_mod
import os
import platform
import sys
from collections.abc import Callable
from typing import cast

from cffi import FFI

ffi = FFI()
ffi.cdef(
    """
    typedef unsigned long aio_context_t;

    struct iocb {
        uint64_t aio_data;
        uint32_t aio_key_or_flags_0;   /* the kernel's PADDED(aio_key, aio_rw_flags): */
        uint32_t aio_key_or_flags_1;   /* order depends on byte order, see below */
        uint16_t aio_lio_opcode;
        int16_t  aio_reqprio;
        uint32_t aio_fildes;
        uint64_t aio_buf;
        uint64_t aio_nbytes;
        int64_t  aio_offset;
        uint64_t aio_reserved2;
        uint32_t aio_flags;
        uint32_t aio_resfd;
    };

    struct io_event {
        uint64_t data;
        int64_t  obj;
        int64_t  res;
        int64_t  res2;
    };

    struct timespec { long tv_sec; long tv_nsec; };

    /* libaio.so.1; io_context_t is a pointer there, the same size as aio_context_t. */
    int io_setup(int maxevents, aio_context_t *ctxp);
    int io_destroy(aio_context_t ctx);
    int io_submit(aio_context_t ctx, long nr, struct iocb **iocbpp);
    int io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event *events,
                     struct timespec *timeout);

    /* libc */
    long syscall(long number, ...);
    """
)

if ffi.sizeof("struct iocb") != 64 or ffi.sizeof("struct io_event") != 32:  # pragma: no cover
    raise ImportError("unexpected struct iocb / io_event size: this platform's ABI differs")

IOCB_CMD_PREAD = 0
IOCB_CMD_PWRITE = 1

#: (io_setup, io_destroy, io_submit, io_getevents) per machine. aarch64 uses the generic
#: table of include/uapi/asm-generic/unistd.h.
_SYSCALLS = {
    "x86_64": (206, 207, 209, 208),
    "aarch64": (0, 1, 2, 4),
    "arm64": (0, 1, 2, 4),
}

#: Byte-order-dependent field that holds aio_rw_flags (RWF_*); we always leave it 0, and
#: aio_key must be 0 too, so both halves are zeroed whatever the order.
LITTLE_ENDIAN = sys.byteorder == "little"


def _symbol(lib: object, name: str) -> Callable[..., int]:
    """A function of a library cffi opened, typed as what it is: a C call returning an int.

    cffi's ``Lib`` objects grow their attributes from the cdef at run time, which no static
    checker can see; this is the one place that bridges the two.
    """
    return cast(Callable[..., int], getattr(lib, name))


def _oserror(code: int, call: str) -> OSError:
    return OSError(code, f"{call}: {os.strerror(code)}")


class _Provider:
    """The four AIO calls with errors as OSError. Subclasses say how to reach the kernel."""

    name = "abstract"

    def _call(self, index: int, *args: object) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def setup(self, maxevents: int) -> int:
        """Create a context for up to ``maxevents`` requests in flight; returns its id."""
        ctxp = ffi.new("aio_context_t *")
        self._check(self._call(0, maxevents, ctxp), "io_setup")
        return int(ctxp[0])

    def destroy(self, ctx: int) -> None:
        """Destroy a context; the kernel waits for requests still in flight."""
        self._check(self._call(1, ctx), "io_destroy")

    def submit(self, ctx: int, nr: int, iocbpp: object) -> int:
        """Queue ``nr`` iocbs; returns how many the kernel took (may be fewer than nr)."""
        return self._check(self._call(2, ctx, nr, iocbpp), "io_submit")

    def getevents(
        self, ctx: int, min_nr: int, nr: int, events: object, timeout_s: float | None
    ) -> int:
        """Wait for at least ``min_nr`` completions (up to ``timeout_s``); returns the count.

        EINTR is retried: a signal delivered to the process must not fail I/O.
        """
        ts = ffi.NULL
        if timeout_s is not None:
            # Initialised by field order (tv_sec, tv_nsec): cffi's struct fields are not
            # attributes a static checker can see.
            seconds = int(timeout_s)
            ts = ffi.new("struct timespec *", [seconds, int((timeout_s - seconds) * 1e9)])
        while True:
            rc = self._call(3, ctx, min_nr, nr, events, ts)
            if rc == -errno_mod.EINTR:
                continue
            return self._check(rc, "io_getevents")

    @staticmethod
    def _check(rc: int, call: str) -> int:
        if rc < 0:
            raise _oserror(-rc, call)
        return rc


class LibAio(_Provider):
    """The calls through ``libaio.so.1``.

    Raises:
        OSError: at construction, when the library cannot be loaded.
    """

    name = "libaio"

    def __init__(self, soname: str = "libaio.so.1") -> None:
        self._lib = ffi.dlopen(soname)
        self._fns = tuple(
            _symbol(self._lib, name)
            for name in ("io_setup", "io_destroy", "io_submit", "io_getevents")
        )

    def _call(self, index: int, *args: object) -> int:
        return int(self._fns[index](*args))


class KernelAio(_Provider):
    """The calls as raw system calls through libc's ``syscall()``.

    Raises:
        OSError: at construction, on a machine whose syscall numbers are not known here
            (errno ENOSYS).
    """

    name = "kernel"

    def __init__(self) -> None:
        numbers = _SYSCALLS.get(platform.machine())
        if numbers is None:
            raise OSError(
                errno_mod.ENOSYS,
                f"kernel AIO syscall numbers are not known for {platform.machine()}",
            )
        self._numbers = numbers
        self._libc = ffi.dlopen(None)
        self._syscall = _symbol(self._libc, "syscall")

    def _call(self, index: int, *args: object) -> int:
        # syscall() is variadic: cffi needs every extra argument as typed cdata.
        typed: list[object] = []
        for a in args:
            if isinstance(a, ffi.CData):
                typed.append(a)
            elif isinstance(a, int):
                typed.append(ffi.cast("long", a))
            else:  # pragma: no cover - the providers above pass only ints and cdata
                raise TypeError(f"syscall argument {a!r}: expected an int or cffi cdata")
        rc = int(self._syscall(ffi.cast("long", self._numbers[index]), *typed))
        if rc == -1:
            return -ffi.errno
        return rc
