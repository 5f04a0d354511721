"""The process group as swapper uses it: rank, size, timeout, and the collectives'
error discipline.

Job: wrap a ``torch.distributed`` process group (:class:`DistGroup`), run every
collective asynchronously and wait on it with a timeout (:func:`wait_work`), turn every
failure into a :class:`~swapper.distributed.errors.CollectiveError` naming the collective, what it
was for and the rank; and the two small agreements made at wrap time and at sync points:
:func:`check_same_model` and :func:`agree`.

Never a hang, two guards:

- the process group's own ``timeout=`` (``init_process_group(timeout=...)``): gloo fails
  an operation that waits longer; NCCL's watchdog aborts the communicator (with
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default since PyTorch 2.2);
- the monitored wait: every collective here is started with ``async_op=True`` and waited on
  with ``Work.wait(timeout=DistGroup.timeout)``, which blocks the calling thread at most
  that long (for NCCL too: with a timeout the wait is on the CPU, not a stream sync; the
  CPU then launches the module's kernels only once its gather is done, while the GPU
  still runs what was queued before. If that ever shows as GPU idle time, the option is a
  stream wait, ``work.wait()``, with NCCL's watchdog as the only timeout: not done yet).

A peer that dies closes its connections: the others' collectives fail at once. A peer
that stalls (alive, not calling the collective) is found by the timeout. A peer that
fails *locally* (an I/O error) should say so at the next agreement point
(:func:`agree`), so that the others raise at once instead of at the timeout.

After a :class:`CollectiveError` the group's state is unknown; destroy it.

Control tensors (digests, flags, norms) live on :attr:`DistGroup.control_device`: the
current CUDA device when the backend is NCCL, else the CPU.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from swapper.distributed.errors import CollectiveError, ModelMismatchError, PeerFailedError
from swapper.distributed.partition import ParamInfo
from tiers.errors import SwapConfigError

__all__ = [
    "DEFAULT_TIMEOUT",
    "DistGroup",
    "agree",
    "all_gather_single",
    "check_same_model",
    "model_digest",
    "reduce_scatter_single",
    "start_collective",
    "wait_work",
]

log = logging.getLogger(__name__)

#: Monitored-wait limit when none is given; pass the same to ``init_process_group``.
DEFAULT_TIMEOUT = timedelta(minutes=10)

# torch >= 2.11 names them *_single; older releases *_tensor (same signature).
all_gather_single: Callable[..., dist.Work | None] = getattr(
    dist, "all_gather_single", dist.all_gather_into_tensor
)
reduce_scatter_single: Callable[..., dist.Work | None] = getattr(
    dist, "reduce_scatter_single", dist.reduce_scatter_tensor
)


@dataclass(frozen=True)
class DistGroup:
    """A process group with what swapper needs of it.

    Attributes:
        group: the process group (None: the default group).
        rank: this process's rank in ``group``.
        world_size: the group's size.
        backend: the backend's name (``"gloo"``, ``"nccl"``, ...).
        timeout: the monitored wait's limit for every collective.
        control_device: where small control tensors live (see the module docstring).
    """

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    backend: str
    timeout: timedelta
    control_device: torch.device
    # The first CollectiveError's message once one was raised (the group is then broken):
    # every later start or wait on this DistGroup raises at once instead of waiting out
    # another timeout per handle (a read-ahead queue of K fetches would otherwise take
    # K timeouts to unwind). A list so that the frozen dataclass can record it.
    _failed: list[str] = field(default_factory=list, compare=False, repr=False)

    @property
    def failed(self) -> str | None:
        """The first collective failure on this group (None while healthy)."""
        return self._failed[0] if self._failed else None

    @classmethod
    def of(
        cls, group: dist.ProcessGroup | None = None, *, timeout: timedelta | float | None = None
    ) -> DistGroup:
        """Wrap ``group`` (None: the default group); ``timeout`` in seconds or a timedelta.

        Raises:
            SwapConfigError: torch.distributed is not initialised, or the timeout is not
                a positive duration.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise SwapConfigError(
                "process_group given but torch.distributed is not initialised: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the "
                "environment it reads)"
            )
        if timeout is None:
            timeout = DEFAULT_TIMEOUT
        elif not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        if timeout.total_seconds() <= 0:
            raise SwapConfigError(f"collective timeout={timeout} must be > 0 seconds")
        rank = dist.get_rank(group)
        if rank < 0:
            raise SwapConfigError(
                "this process is not a member of the process_group given; pass a group "
                "that contains every rank that trains this model"
            )
        backend = str(dist.get_backend(group))
        if "nccl" in backend and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        return cls(
            group=group,
            rank=rank,
            world_size=dist.get_world_size(group),
            backend=backend,
            timeout=timeout,
            control_device=device,
        )

    def error(self, collective: str, what: str, detail: str, *, timed_out: bool) -> CollectiveError:
        """A CollectiveError for this rank, with a message that says what to do; marks the
        group failed (see :attr:`failed`)."""
        head = f"{collective} for {what} failed on rank {self.rank} of {self.world_size}"
        if not self._failed:
            self._failed.append(f"{head}: {detail}")
        return CollectiveError(
            f"{head} ({self.backend}): {detail}. A peer rank died, stalled past the "
            f"{self.timeout.total_seconds():g} s timeout, or raised; look at the other "
            "ranks' logs for the first error. The process group cannot be reused: "
            "destroy it and restart from the last checkpoint.",
            collective=collective,
            what=what,
            rank=self.rank,
            world_size=self.world_size,
            timed_out=timed_out,
        )


def start_collective(
    dg: DistGroup, collective: str, what: str, start: Callable[[], dist.Work | None]
) -> dist.Work | None:
    """Call ``start`` (which must pass ``async_op=True``) and return its work handle.

    Raises:
        CollectiveError: the backend refused or failed the call synchronously, or an
            earlier collective on ``dg`` failed (then nothing is started).
    """
    _raise_if_failed(dg, collective, what)
    try:
        return start()
    except (RuntimeError, ValueError) as exc:  # DistBackendError is a RuntimeError
        raise dg.error(collective, what, f"{type(exc).__name__}: {exc}", timed_out=False) from exc


def wait_work(dg: DistGroup, work: dist.Work | None, collective: str, what: str) -> None:
    """Wait on ``work`` at most ``dg.timeout``.

    Raises:
        CollectiveError: the collective failed, or did not finish in time
            (``timed_out`` True), or an earlier collective on ``dg`` failed (then it
            raises at once, without waiting).
    """
    if work is None:
        return
    _raise_if_failed(dg, collective, what)
    try:
        finished = work.wait(timeout=dg.timeout)
    except (RuntimeError, ValueError) as exc:
        text = str(exc)
        timed_out = "timed out" in text.lower() or "timeout" in text.lower()
        detail = f"{type(exc).__name__}: {text}"
        raise dg.error(collective, what, detail, timed_out=timed_out) from exc
    except BaseException as exc:  # KeyboardInterrupt, SystemExit: left mid-collective
        # This rank stops waiting with the collective's outcome unknown: the group can no
        # longer be trusted, so later collectives on it fail at once (then re-raise).
        if not dg._failed:
            dg._failed.append(f"{collective} for {what} interrupted ({type(exc).__name__})")
        raise
    if finished is False:  # some backends report a timeout by returning False
        raise dg.error(collective, what, "not finished within the timeout", timed_out=True)


def _raise_if_failed(dg: DistGroup, collective: str, what: str) -> None:
    if dg.failed is not None:
        raise dg.error(
            collective, what, f"not attempted: the group already failed ({dg.failed})",
            timed_out=False,
        )  # fmt: skip


def _run(dg: DistGroup, collective: str, what: str, start: Callable[[], dist.Work | None]) -> None:
    wait_work(dg, start_collective(dg, collective, what, start), collective, what)


def gather_codes(dg: DistGroup, code: int, what: str) -> list[int]:
    """Every rank's ``code`` (0..255), in rank order: an agreement point that says more
    than :func:`agree`'s ok or not (one all_gather of one byte per rank; call it on every
    rank at the same point).

    Raises:
        SwapConfigError: ``code`` is not in 0..255.
        CollectiveError: the all_gather failed or timed out.
    """
    if not 0 <= code <= 255:
        raise SwapConfigError(f"{what}: code {code} is not one byte (0..255)")
    mine = torch.tensor([code], dtype=torch.uint8, device=dg.control_device)
    codes = torch.empty(dg.world_size, dtype=torch.uint8, device=dg.control_device)
    _gather(dg, codes, mine, what)
    return [int(c) for c in codes.tolist()]


def _gather(dg: DistGroup, out: torch.Tensor, mine: torch.Tensor, what: str) -> None:
    def start() -> dist.Work | None:
        return all_gather_single(out, mine, group=dg.group, async_op=True)

    _run(dg, "all_gather", what, start)


def model_digest(params: Sequence[ParamInfo]) -> bytes:
    """SHA-256 of the (name, shape, dtype) list, in order (32 bytes)."""
    h = hashlib.sha256()
    for p in params:
        h.update(repr((p.name, tuple(p.shape), p.dtype)).encode())
        h.update(b"\0")
    return h.digest()


def check_same_settings(dg: DistGroup, settings: Mapping[str, object]) -> None:
    """Check that every rank wraps with the same values of the settings that decide which
    collectives run, in which order (read-ahead depth, fetch method, whether the step
    reduces a norm, the device budget that bounds read-ahead): one all_gather of an 8-byte
    digest; ranks that differed would pair different collectives and hang until the
    timeout, or worse, pair them wrongly.

    Raises:
        SwapConfigError: on every rank, naming the first differing setting (by name) and
            its value on rank 0 and on the first rank that differs.
        CollectiveError: a collective failed or timed out.
    """
    what = "the settings every rank must share"
    shown = {key: repr(settings[key]) for key in sorted(settings)}
    (value,) = struct.unpack("<q", hashlib.sha256(repr(shown).encode()).digest()[:8])
    mine = torch.tensor([value], dtype=torch.int64, device=dg.control_device)
    gathered = torch.empty(dg.world_size, dtype=torch.int64, device=dg.control_device)
    _gather(dg, gathered, mine, what)
    if all(int(v) == value for v in gathered.tolist()):
        return
    everyone: list[object] = [None] * dg.world_size
    try:
        dist.all_gather_object(everyone, shown, group=dg.group)
    except (RuntimeError, ValueError) as exc:
        raise dg.error("all_gather_object", what, str(exc), timed_out=False) from exc
    tables = [x if isinstance(x, dict) else {} for x in everyone]
    for key in sorted(set().union(*tables)):
        values = [t.get(key, "(not set)") for t in tables]
        differing = [r for r in range(dg.world_size) if values[r] != values[0]]
        if differing:
            other = differing[0]
            raise SwapConfigError(
                f"the ranks wrap with different settings: {key} is {values[0]} on rank 0 "
                f"but {values[other]} on rank {other} (this is rank {dg.rank}); every rank "
                f"must pass the same {key}"
            )
    raise SwapConfigError(  # digests differ, tables equal: a repr that is not stable
        f"the ranks' settings differ in a way their values do not show (this is rank {dg.rank})"
    )


def check_same_model(dg: DistGroup, params: Sequence[ParamInfo]) -> None:
    """Check that every rank wraps the same model: one all_gather of an 8-byte digest.

    On a mismatch (only then) the ranks exchange their lists (``all_gather_object``) so
    that every rank names the same first differing parameter. (With NCCL that object
    exchange goes through the current CUDA device: call ``torch.cuda.set_device(local
    rank)`` before wrapping, as torchrun scripts do.)

    Raises:
        ModelMismatchError: on every rank, naming the first parameter (in forward order)
            whose name, shape or dtype differs between rank 0 and some rank.
        CollectiveError: a collective failed or timed out.
    """
    what = "the wrapped model's (name, shape, dtype) list"
    (value,) = struct.unpack("<q", model_digest(params)[:8])
    mine = torch.tensor([value], dtype=torch.int64, device=dg.control_device)
    gathered = torch.empty(dg.world_size, dtype=torch.int64, device=dg.control_device)
    _gather(dg, gathered, mine, what)
    if all(int(v) == value for v in gathered.tolist()):
        return
    rows = [(p.name, tuple(p.shape), p.dtype) for p in params]
    everyone: list[object] = [None] * dg.world_size
    try:
        dist.all_gather_object(everyone, rows, group=dg.group)
    except (RuntimeError, ValueError) as exc:
        raise dg.error("all_gather_object", what, str(exc), timed_out=False) from exc
    lists = [list(x) if isinstance(x, list) else [] for x in everyone]
    first = len(min(lists, key=len))
    other = 1
    for i in range(max(len(x) for x in lists)):
        entries = [x[i] if i < len(x) else None for x in lists]
        differing = [r for r in range(dg.world_size) if entries[r] != entries[0]]
        if differing:
            first, other = i, differing[0]
            break
    a = lists[0][first] if first < len(lists[0]) else "(no parameter)"
    b = lists[other][first] if first < len(lists[other]) else "(no parameter)"
    mine_row = rows[first] if first < len(rows) else None
    raise ModelMismatchError(
        f"the ranks wrap different models: parameter {first} in forward order is {a} on "
        f"rank 0 but {b} on rank {other} (this is rank {dg.rank}). Every rank must build "
        "the same model (same config, same dtype) before swapper.offload(...).",
        index=first,
        name=mine_row[0] if mine_row else None,
        rank=dg.rank,
        other_rank=other,
    )


def agree(dg: DistGroup, ok: bool, what: str) -> None:
    """Agreement point: every rank says whether its local work succeeded (one all_gather
    of one byte per rank); if any did not, every rank raises.

    Call it on every rank at the same point (e.g. after a step's local I/O, before its
    results are committed), with ``ok=False`` from an ``except`` block that will re-raise
    the local error afterwards on the failing rank.

    Raises:
        PeerFailedError: some rank passed ``ok=False`` (on every rank, naming them).
        CollectiveError: the agreement itself failed or timed out.
    """
    failed = tuple(r for r, f in enumerate(gather_codes(dg, 0 if ok else 1, what)) if f)
    if failed:
        raise peer_failed(
            dg,
            what,
            failed,
            f"{what}: rank(s) {list(failed)} of {dg.world_size} failed locally, so rank "
            f"{dg.rank} stops too; the failing rank's own error says why.",
        )


def peer_failed(dg: DistGroup, what: str, failed: tuple[int, ...], message: str) -> PeerFailedError:
    """The :class:`PeerFailedError` of an agreement point ``what`` on this rank, where
    ranks ``failed`` reported a local failure."""
    return PeerFailedError(
        message,
        collective="agree",
        what=what,
        rank=dg.rank,
        world_size=dg.world_size,
        failed_ranks=failed,
    )
