"""I/O settings: a frozen, keyword-only dataclass validated on construction.

Every setting has an environment variable (read by :meth:`AioConfig.from_env`); the
table in docs/configuration.md lists them with their defaults.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tiers.errors import SwapConfigError
from tiers.units import format_size, parse_size

#: O_DIRECT needs buffer address, file offset and length aligned to the device's logical
#: block size (512 B on most disks, 4 KiB on some). 4 KiB satisfies both.
DIRECT_ALIGNMENT = 4096


class Backend(str, enum.Enum):
    """How requests reach the kernel."""

    AUTO = "auto"  #: libaio, else kernel, else threads; the choice and reason are logged once
    LIBAIO = "libaio"  #: native Linux AIO through libaio.so.1 (cffi, ABI mode)
    KERNEL = "kernel"  #: the same kernel calls through libc's syscall(), no libaio needed
    THREADS = "threads"  #: os.preadv / os.pwritev in a thread pool; portable


E = TypeVar("E", bound=enum.Enum)


def enum_names(cls: type[enum.Enum]) -> str:
    """The values of enum ``cls``, for messages: ``"auto, libaio, kernel, threads"``."""
    return ", ".join(str(member.value) for member in cls)


def parse_enum(
    cls: type[E], value: object, name: str, error: type[Exception] = SwapConfigError
) -> E:
    """``value`` as a member of enum ``cls``: a member, or a member's value.

    The one enum-from-string of the settings (backends, policies, kinds, tiers); ``name``
    is how the message names the setting or argument.

    Raises:
        error: ``value`` is no member's value (also for unhashable values); the message is
            ``{name}={value!r} is not one of: {values}``.
    """
    try:
        return cls(value)
    except (ValueError, TypeError):  # TypeError: an unhashable value such as a list
        raise error(f"{name}={value!r} is not one of: {enum_names(cls)}") from None


#: The longest wait a timeout may ask for, in seconds: what ``threading`` can wait
#: (``Condition.wait`` raises OverflowError beyond it; about 292 years on Linux).
MAX_TIMEOUT_S = threading.TIMEOUT_MAX


def check_timeout_s(name: str, value: object, error: type[ValueError] = ValueError) -> float:
    """``value`` as a timeout in seconds, if it is a finite number in (0, MAX_TIMEOUT_S].

    ``name`` is how the message names it (a setting or an argument).

    Raises:
        error: not a number (bools are not), or NaN, infinite, zero, negative or larger
            than :data:`MAX_TIMEOUT_S`.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{name}={value!r} must be a number of seconds, not {type(value).__name__}")
    # Comparisons, not float(value): an int too large for a float must not OverflowError.
    if not 0 < value <= MAX_TIMEOUT_S:  # also false for NaN
        raise error(
            f"{name}={value!r} must be a finite number of seconds > 0 (at most "
            f"{MAX_TIMEOUT_S:.0f}); give the longest wait you accept"
        )
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AioConfig:
    """Settings of an :class:`~tiers.aio.AioEngine`.

    Attributes:
        backend: which backend runs requests (``SWAPPER_AIO_BACKEND``).
        block_size: bytes per kernel request; large requests are split into pieces of this
            size. A multiple of 4096 (``SWAPPER_AIO_BLOCK_SIZE``).
        queue_depth: requests in flight per worker (``SWAPPER_AIO_QUEUE_DEPTH``).
        num_threads: workers; one large request is split across them
            (``SWAPPER_AIO_THREADS``; DeepSpeed calls this ``intra_op_parallelism``).
        direct: use O_DIRECT where the filesystem allows it (``SWAPPER_AIO_DIRECT``).
        close_timeout_s: seconds ``close()`` waits for requests in flight; a finite
            number > 0 (``SWAPPER_AIO_CLOSE_TIMEOUT``).
        single_submit: hand the kernel one request per ``io_submit`` call, as fio does,
            instead of a batch (``SWAPPER_AIO_SINGLE_SUBMIT``; DeepSpeed's
            ``single_submit``). A batch is plugged and merged by the block layer (four
            1 MiB pieces become one 4 MiB request); on the virtio disks measured in
            docs/benchmarks.md the unmerged requests read about 10% faster.
    """

    backend: Backend = Backend.AUTO
    block_size: int = 1 << 20
    queue_depth: int = 32
    num_threads: int = 1
    direct: bool = True
    close_timeout_s: float = 60.0
    single_submit: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "num_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise SwapConfigError(f"{name}={value!r} must be an integer")
        for name in ("direct", "single_submit"):
            if not isinstance(getattr(self, name), bool):
                raise SwapConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        for name in _TIMEOUT_SETTINGS:
            check_timeout_s(name, getattr(self, name), SwapConfigError)
        object.__setattr__(self, "backend", parse_enum(Backend, self.backend, "backend"))
        if self.block_size <= 0 or self.block_size % DIRECT_ALIGNMENT:
            raise SwapConfigError(
                f"block_size={self.block_size} must be a positive multiple of "
                f"{DIRECT_ALIGNMENT} bytes (e.g. 1MiB)"
            )
        if not 1 <= self.queue_depth <= 1024:
            raise SwapConfigError(f"queue_depth={self.queue_depth} must be between 1 and 1024")
        if not 1 <= self.num_threads <= 64:
            raise SwapConfigError(f"num_threads={self.num_threads} must be between 1 and 64")

    def describe(self) -> str:
        """One line for logs: ``libaio, bs 1 MiB, qd 32, threads 1, direct``."""
        direct = "direct" if self.direct else "buffered"
        return (
            f"{self.backend.value}, bs {format_size(self.block_size)}, qd {self.queue_depth}, "
            f"threads {self.num_threads}, {direct}"
        )

    @staticmethod
    def env_values(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The settings the ``SWAPPER_AIO_*`` variables set, parsed (field name → value);
        those not set are absent. The one place the environment is read: callers that
        keep defaults of their own (``swapper-bench``'s 8 MiB block size) take the
        variables over those defaults and their flags over the variables.

        Raises:
            SwapConfigError: a variable's value does not parse; the message names it.
                (Values are validated by the constructor: see :meth:`from_env`.)
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, (var, parse) in _ENV.items():
            if var in env:
                try:
                    values[name] = parse(env[var])
                except ValueError as exc:
                    raise SwapConfigError(f"{var}={env[var]!r}: {exc}") from None
        return values

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> AioConfig:
        """Build a config from ``SWAPPER_AIO_*`` variables; ``overrides`` win over them.

        Raises:
            SwapConfigError: a variable holds a value that does not parse or validate; the
                message names the variable.
        """
        env = os.environ if environ is None else environ
        values = cls.env_values(env)
        values.update(overrides)
        try:
            return cls(**values)
        except SwapConfigError as exc:
            # Validation messages start with the setting's name: point at the variable.
            for name, (var, _) in _ENV.items():
                if str(exc).startswith(f"{name}=") and var in env and name not in overrides:
                    raise SwapConfigError(f"{var}={env[var]!r}: {exc}") from None
            raise

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], **overrides: Any) -> AioConfig:
        """Build a config from a mapping; ``overrides`` win over it.

        Accepts the whole file that ``swapper-bench --emit-config`` writes
        (``{"swapper": {"aio": {...}}, "deepspeed": {...}}``; everything outside
        ``swapper.aio`` is ignored), ``{"aio": {...}}``, or the ``aio`` section itself:
        ``{"backend": "libaio", "block_size": 8388608, "queue_depth": 32, "num_threads": 1,
        "direct": true}``. Values are JSON types, or strings as in the environment
        variables (``"8MiB"``, ``"true"``).

        Raises:
            SwapConfigError: the section has keys that are not settings (named), or a value
                of the wrong type, or one that does not validate.
        """
        section = _aio_section(mapping)
        unknown = sorted(str(key) for key in section if key not in _ENV)
        if unknown:
            raise SwapConfigError(
                f"unknown aio setting(s): {', '.join(unknown)} (known: {', '.join(_ENV)})"
            )
        values = {name: _coerce_setting(name, value) for name, value in section.items()}
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], **overrides: Any) -> AioConfig:
        """Load a config from a JSON file; see :meth:`from_dict` for the accepted shapes.

        Raises:
            OSError: the file cannot be read.
            SwapConfigError: it is not JSON, or its ``aio`` section does not validate; the
                message names the file.
        """
        data = read_json_object(path)
        try:
            return cls.from_dict(data, **overrides)
        except SwapConfigError as exc:
            raise SwapConfigError(f"{os.fspath(path)}: {exc}") from None


def _aio_section(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``aio`` settings inside an emitted config file, ``{"aio": ...}`` or the section."""
    section: Any = mapping
    for key in ("swapper", "aio"):
        if isinstance(section, Mapping) and key in section:
            section = section[key]
    if not isinstance(section, Mapping):
        raise SwapConfigError(f"the aio section must be an object, got {type(section).__name__}")
    return section


def _coerce_setting(name: str, value: Any) -> Any:
    """A JSON value for setting ``name`` as the dataclass field wants it."""
    if isinstance(value, str) and not isinstance(value, Backend):
        try:
            return _ENV[name][1](value)
        except ValueError as exc:
            raise SwapConfigError(f"aio setting {name}={value!r}: {exc}") from None
    # Other types are checked by __post_init__, whose messages name the setting.
    return value


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


#: Settings that are timeouts in seconds: each must be finite and > 0.
_TIMEOUT_SETTINGS = ("close_timeout_s",)

_ENV: dict[str, tuple[str, Any]] = {
    "backend": ("SWAPPER_AIO_BACKEND", str),
    "block_size": ("SWAPPER_AIO_BLOCK_SIZE", parse_size),
    "queue_depth": ("SWAPPER_AIO_QUEUE_DEPTH", int),
    "num_threads": ("SWAPPER_AIO_THREADS", int),
    "direct": ("SWAPPER_AIO_DIRECT", _parse_bool),
    "close_timeout_s": ("SWAPPER_AIO_CLOSE_TIMEOUT", float),
    "single_submit": ("SWAPPER_AIO_SINGLE_SUBMIT", _parse_bool),
}


def check_swap_dirs(dirs: Sequence[str | os.PathLike[str]], setting: str = "nvme_dirs") -> None:
    """Each swap directory must be usable before a store is made in it: an existing
    directory this process may write in, or a missing one whose nearest existing
    ancestor is a directory it may write in (the store makes the missing ones). Checked
    when a store is created, so that a typo or a permission is named at once, not
    found by the first write.

    Args:
        dirs: the swap directories.
        setting: how messages name them (``nvme_dirs``, ``--dir``).

    Raises:
        SwapConfigError: one is not a directory, or cannot be written, or cannot be made;
            the message names ``setting``, the path and what to do.
    """
    for d in dirs:
        path = Path(os.path.abspath(os.fspath(d)))
        if os.path.lexists(path):
            if not path.is_dir():
                raise SwapConfigError(
                    f"{setting}: {os.fspath(path)!r} exists and is not a directory: name a "
                    "directory (one that does not exist yet is made)"
                )
            if not os.access(path, os.W_OK | os.X_OK):
                raise SwapConfigError(
                    f"{setting}: directory {os.fspath(path)!r} is not writable by this "
                    f"process (uid {os.geteuid()}): choose one you can write in, or change "
                    "its permissions"
                )
            continue
        ancestor = next(p for p in path.parents if os.path.lexists(p))
        if not ancestor.is_dir():
            raise SwapConfigError(
                f"{setting}: {os.fspath(path)!r} cannot be made: {os.fspath(ancestor)!r} "
                "is not a directory"
            )
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise SwapConfigError(
                f"{setting}: {os.fspath(path)!r} does not exist and cannot be made: "
                f"{os.fspath(ancestor)!r} is not writable by this process (uid "
                f"{os.geteuid()}); create the directory first, or choose another"
            )


def read_json_object(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """The JSON object in file ``path``.

    Raises:
        OSError: the file cannot be read.
        SwapConfigError: it is not JSON, or not an object at the top (names the file).
    """
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SwapConfigError(f"{os.fspath(path)}: not valid JSON: {exc}") from None
    if not isinstance(data, Mapping):
        raise SwapConfigError(f"{os.fspath(path)}: expected a JSON object at the top")
    return data
