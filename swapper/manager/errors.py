"""Errors of the tier manager. Every message names the key it concerns."""

from __future__ import annotations

from tiers.errors import IOTimeoutError, SwapError

__all__ = [
    "EntryInUseError",
    "IllegalTransitionError",
    "KeyExistsError",
    "ManagerClosedError",
    "ManagerIOTimeout",
    "ManagerTimeout",
    "NotDurableError",
    "NotInUseError",
    "UnknownKeyError",
]


class UnknownKeyError(SwapError, KeyError):
    """No tensor is registered under the key."""

    def __str__(self) -> str:
        # KeyError's str() is the repr of its argument; a message reads better plainly.
        return str(self.args[0]) if self.args else ""


class KeyExistsError(SwapError, ValueError):
    """A tensor is already registered under the key."""


class EntryInUseError(SwapError, RuntimeError):
    """The operation needs the tensor not to be in use (fetched and not yet released)."""


class IllegalTransitionError(SwapError, RuntimeError):
    """A state change the transition table does not allow: a bug in the manager."""


class ManagerClosedError(SwapError, RuntimeError):
    """The manager is closed or closing."""


class ManagerTimeout(SwapError, TimeoutError):
    """Waited longer than the configured timeout for another thread's transfer of a key."""


class ManagerIOTimeout(IOTimeoutError, ManagerTimeout):
    """A :class:`ManagerTimeout` whose wait was for a read or write of the key that the
    disk has not completed (a registration's write, another thread's read-ahead or
    eviction): an :class:`~tiers.errors.IOTimeoutError` too, naming the file and offset of
    the piece still in flight (``path``, ``offset``, ``nbytes``)."""


class NotDurableError(SwapError, RuntimeError):
    """Some tensors could not be made durable on NVMe.

    Attributes:
        keys: the keys whose current bytes are not on NVMe, sorted.
        errors: key → the error that stopped its write (absent for writes still in flight).
    """

    def __init__(self, message: str, *, keys: list[str], errors: dict[str, BaseException]):
        super().__init__(message)
        self.keys = keys
        self.errors = errors


class NotInUseError(SwapError, ValueError):
    """``release`` of a key that no ``fetch`` is holding."""
