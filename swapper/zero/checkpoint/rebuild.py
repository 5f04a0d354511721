"""16-bit parameters a training snapshot leaves out and a resume rebuilds from the fp32 master.

Job: keep a snapshot taken right after a step to what the step did not already make
durable. When ``step()`` returns, the optimizer's state is on NVMe, but the 16-bit
parameters it published sit dirty in host memory: writing them would cost 2 of the 14
bytes per parameter (14 % of the state) at every snapshot. They hold nothing of their
own: :meth:`OffloadAdamW._publish <swapper.step.OffloadAdamW>` sets each one to its fp32
master weights rounded to 16 bits (``param16.copy_(master)``, round to nearest even, the
same conversion as ``master.to(dtype)``, for bf16 and fp16; a plain copy for a trainable
fp32 parameter, such as PEFT's default adapters); a step skipped for overflow changes
neither. So such a parameter is left out of the snapshot (not written, not named
by the store snapshot: :func:`swapper.manager.snapshot.snapshot_manager` ``leave_out``);
the snapshot's metadata records, under ``"rebuilt"``, how to rebuild it and an XXH3-64 of
its bytes::

    [{"key": "param16/param/h.0.attn.weight", "dtype": "bfloat16", "shape": [768, 768],
      "xxh3_64": "<16 hex digits>",
      "pieces": [["optim_state/adamw/state/3", <element of that flattened state>,
                  <element of the flattened parameter>, <elements>], ...]}, ...]

(keys as the store names them: ``<kind>/<manager key>``)

and a resume (:class:`Rebuilder`, while it reads the snapshot's tensors to verify them)
rounds those master ranges of the snapshot's own state tensors into the parameter,
checks the digest (a difference: :class:`SnapshotDamagedError` naming the file and the
parameter; the snapshot before is used) and registers it dirty in memory, as it was.

Which parameters: a parameter dirty in memory is left out only when every piece of it is
known to equal its master rounded, else it is written as before:

* master in a sub-group kept in memory (``host_fraction``): compared bitwise, in memory;
* master streamed from NVMe: a post-step hook (:func:`_after_step`, torch's global
  optimizer step hook, registered when this module is imported, so every
  :class:`OffloadAdamW` step from the first is seen) records, after each completed step
  that was not skipped, the modification counter of every parameter and state tensor of
  the optimizer; the piece qualifies when neither the parameter nor that state tensor
  was released as modified since. ``load_state_dict``, ``import_dcp``, a
  ``model.load_state_dict`` or an in-place write in a forward all bump a counter.

So frozen parameters (no master), parameters written outside the step, and a snapshot
before the first step after a resume (the record starts at a step) write them. With an
overlapped step (``StepConfig(overlap=True)``, :mod:`swapper.step.deferred`) the hook runs
when ``step()`` returns, before the background update publishes: the counters then differ
at the snapshot and the parameters are written (safe, no saving yet); several ranks'
parts (:mod:`swapper.zero.checkpoint.shard_snapshot`) are written whole too.

Why not write the parameters behind during the step (so they are clean at the snapshot):
that moves the same 2 bytes per parameter into every step, snapshot or not, and needs
the step pipeline to know about parameters; leaving them out costs nothing when no
snapshot is taken and a resume reads the state tensors anyway (to verify them).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from swapper.manager import Kind
from swapper.manager.snapshot import dirty_in_memory, entry_versions
from swapper.step.optimizer import StreamedOptimizer
from tiers import signals
from tiers.nvme import NvmeStore, content_hash
from tiers.nvme.snapshots import SnapshotDamagedError, SnapshotInfo

if TYPE_CHECKING:
    from swapper.manager import TierManager

__all__ = ["LeftOut", "Rebuilder", "choose_left_out", "register_rebuilt"]

# fp32: a trainable fp32 parameter (PEFT's default adapters) published from its master
# unrounded (``copy_`` between equal dtypes), so rebuilding it is a copy, checked the same way
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ROW_FIELDS = frozenset({"key", "dtype", "shape", "xxh3_64", "pieces"})
_PARAM = f"{Kind.PARAM16.value}/"  # the store's prefix of a 16-bit parameter's key
_STATE = Kind.OPTIM_STATE.value


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Elements ``[param_offset, param_offset + numel)`` of a flattened parameter are
    its master at elements ``[state_offset, ...)`` of the flattened state ``state_key``
    (row 0 of a sub-group's state), rounded to 16 bits."""

    state_key: str
    state_offset: int
    param_offset: int
    numel: int
    held: bool  # the sub-group is kept in memory


@dataclasses.dataclass
class _Record:
    """Counters of the optimizer's tensors right after its last completed step."""

    versions: dict[str, int]


#: per optimizer: its tensors' counters after its last step that was not skipped
_records: weakref.WeakKeyDictionary[StreamedOptimizer, _Record] = weakref.WeakKeyDictionary()


def _pieces(optimizer: StreamedOptimizer) -> dict[str, list[_Piece]]:
    """Parameter key → the pieces its masters cover, in parameter order (empty when the
    optimizer's parameters are not a tiered model's)."""
    view = optimizer.stored_state
    slot_of = getattr(view.source, "_slot", None)
    if slot_of is None:
        return {}
    found: dict[str, list[_Piece]] = {}
    for sg in view.sub_groups:
        key = view.key(sg.index)
        for piece in sg.pieces:
            param_key = slot_of(view.param(sg, piece.param_index)).key
            found.setdefault(param_key, []).append(
                _Piece(key, piece.offset, piece.param_offset, piece.numel, view.is_held(sg.index))
            )
    return found


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's post-step hook: record the counters after a completed, not skipped step of
    an :class:`OffloadAdamW` (a skipped step changed nothing: the record stays)."""
    if not isinstance(optimizer, StreamedOptimizer) or optimizer.stored_state.closed:
        return
    view = optimizer.stored_state
    report = optimizer.last_step
    if report is None or report.skipped or view.pending is not None:
        return
    keys = [view.key(sg.index) for sg in view.sub_groups]
    keys += list(_pieces(optimizer))
    _records[optimizer] = _Record(entry_versions(optimizer.manager, keys))


register_optimizer_step_post_hook(_after_step)


@dataclasses.dataclass(frozen=True)
class LeftOut:
    """What :func:`choose_left_out` found.

    Attributes:
        versions: key → counter, for ``snapshot_manager(leave_out=...)``.
        record: the snapshot metadata's ``"rebuilt"`` list (module docstring).
        nbytes: their bytes.
    """

    versions: dict[str, int]
    record: list[dict[str, Any]]
    nbytes: int


def choose_left_out(manager: TierManager, optimizer: StreamedOptimizer | None) -> LeftOut:
    """The 16-bit parameters dirty in memory that a snapshot may leave out because they
    are exactly their masters rounded (module docstring), with their digests. Reads only
    memory. Call it between steps, before the kept sub-groups are released.

    Raises:
        what :func:`~swapper.manager.snapshot.dirty_in_memory` and ``manager.fetch`` raise.
    """
    none = LeftOut({}, [], 0)
    if optimizer is None:
        return none
    record = _records.get(optimizer)
    if record is None:
        return none
    pieces = _pieces(optimizer)
    dirty = dirty_in_memory(manager, pieces)
    now = entry_versions(manager, {p.state_key for k in dirty for p in pieces[k]})
    view = optimizer.stored_state
    held = {view.key(index): state for index, state in view.held().items()}
    versions: dict[str, int] = {}
    rows: list[dict[str, Any]] = []
    nbytes = 0
    for key, (version, tier) in dirty.items():
        info = manager.info(key)
        numel = math.prod(info.shape)
        mine = pieces[key]
        if sum(p.numel for p in mine) != numel:
            continue  # (not all of it has a master)
        streamed = [p for p in mine if not p.held]
        if streamed and (
            record.versions.get(key) != version
            or any(record.versions.get(p.state_key) != now.get(p.state_key) for p in streamed)
        ):
            continue  # written since the step: its bytes are its own
        # In a section: a Ctrl-C arriving between the fetch and the try would leave the
        # entry in use with no holder (every later snapshot and step refused).
        with signals.at_waits:
            tensor = manager.fetch(key, tier)
            try:
                flat = tensor.detach().reshape(-1).cpu()
                same = all(_equal_rounded(flat, p, held[p.state_key]) for p in mine if p.held)
                digest = content_hash(flat) if same else 0
            finally:
                manager.release(key, modified=False)
        if not same:
            continue
        versions[key] = version
        nbytes += info.nbytes
        rows.append(
            {
                "key": f"{Kind.PARAM16.value}/{key}",
                "dtype": str(info.dtype).removeprefix("torch."),
                "shape": list(info.shape),
                "xxh3_64": f"{digest:016x}",
                "pieces": [
                    [f"{_STATE}/{p.state_key}", p.state_offset, p.param_offset, p.numel]
                    for p in mine
                ],
            }
        )
    return LeftOut(versions, rows, nbytes)


def _equal_rounded(flat: torch.Tensor, piece: _Piece, state: torch.Tensor) -> bool:
    """Whether the parameter's piece has the bits of its master rounded (bitwise: -0.0
    and +0.0 differ, a NaN equals a NaN of the same bits)."""
    # (the state's first elements are the fp32 masters, whether it is a (3, n) fp32 tensor
    # or the uint8 bytes of compressed moments: swapper.step.layout)
    flat32 = state.reshape(-1).view(torch.float32)
    master = flat32[piece.state_offset : piece.state_offset + piece.numel]
    part = flat[piece.param_offset : piece.param_offset + piece.numel]
    return torch.equal(master.to(part.dtype).view(torch.int16), part.view(torch.int16))


class Rebuilder:
    """At resume: the left-out parameters of one snapshot, rebuilt from its state
    tensors as :func:`~swapper.zero.checkpoint.resume._check` reads them (:meth:`feed`), then
    checked against their digests (:meth:`finish`).

    Raises (at construction):
        SnapshotDamagedError: the ``"rebuilt"`` record is malformed: not a list of the
            documented objects, pieces that do not tile the parameter exactly, a state
            tensor the snapshot does not name as float32 or too short for a piece, or a
            key the snapshot also names (each names the file and the entry).
    """

    def __init__(self, raw: object, store: NvmeStore, info: SnapshotInfo, where: str) -> None:
        self._where = where
        #: parameter key → (dtype, shape, digest)
        self._wanted: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        #: state key → (parameter key, state offset, parameter offset, elements)
        self._by_state: dict[str, list[tuple[str, int, int, int]]] = {}
        self._built: dict[str, torch.Tensor] = {}
        self._fed: set[str] = set()
        if not isinstance(raw, list):
            raise SnapshotDamagedError(f"{where}: rebuilt is not a list")
        for i, row in enumerate(raw):
            self._parse(row, f"{where}: rebuilt[{i}]", store, info)

    def _parse(self, row: object, at: str, store: NvmeStore, info: SnapshotInfo) -> None:
        if not isinstance(row, dict) or row.keys() != _ROW_FIELDS:
            raise SnapshotDamagedError(f"{at} is not an object of fields {sorted(_ROW_FIELDS)}")
        key, dtype, shape, digest = row["key"], row["dtype"], row["shape"], row["xxh3_64"]
        if (
            not isinstance(key, str)
            or not key.startswith(_PARAM)
            or key in info.keys
            or key in self._wanted
        ):
            raise SnapshotDamagedError(
                f"{at}: key {key!r} is not a {_PARAM}... key the snapshot lacks"
            )
        at = f"{at} ({key})"
        if dtype not in _DTYPES:
            raise SnapshotDamagedError(f"{at}: dtype {dtype!r} is not bfloat16, float16 or float32")
        if not isinstance(shape, list) or not all(_count(d) for d in shape):
            raise SnapshotDamagedError(f"{at}: shape {shape!r} is not a list of ints >= 0")
        try:
            if not isinstance(digest, str) or len(digest) != 16:
                raise ValueError
            expected = int(digest, 16)
        except ValueError:
            raise SnapshotDamagedError(f"{at}: xxh3_64 {digest!r} is not 16 hex digits") from None
        numel = math.prod(shape)
        self._wanted[key] = (_DTYPES[dtype], tuple(shape), expected)
        pieces = row["pieces"]
        if not isinstance(pieces, list):
            raise SnapshotDamagedError(f"{at}: pieces is not a list")
        covered = 0
        for piece in pieces:
            if (
                not isinstance(piece, list)
                or len(piece) != 4
                or not isinstance(piece[0], str)
                or not all(_count(v) for v in piece[1:])
            ):
                raise SnapshotDamagedError(f"{at}: piece {piece!r} is not [str, int, int, int]")
            state_key, state_offset, param_offset, count = piece
            if param_offset != covered or count == 0:
                raise SnapshotDamagedError(
                    f"{at}: its pieces do not tile it (one starts at element {param_offset}, "
                    f"expected {covered})"
                )
            covered += count
            if state_key not in info.keys:
                raise SnapshotDamagedError(f"{at}: the snapshot holds no state {state_key!r}")
            stored = store.snapshot_tensor(info.name, state_key)
            elements = math.prod(stored.shape) * stored.dtype.itemsize // 4  # as fp32
            if stored.dtype not in (torch.float32, torch.uint8) or state_offset + count > elements:
                raise SnapshotDamagedError(
                    f"{at}: state {state_key!r} ({stored.dtype}, {list(stored.shape)}) has no "
                    f"fp32 elements {state_offset}..{state_offset + count}"
                )
            self._by_state.setdefault(state_key, []).append(
                (key, state_offset, param_offset, count)
            )
        if covered != numel:
            raise SnapshotDamagedError(f"{at}: its pieces cover {covered} of {numel} elements")

    def feed(self, key: str, data: torch.Tensor) -> None:
        """The snapshot's bytes of ``key`` (uint8, read and verified): the pieces it holds
        are rounded into their parameters."""
        uses = self._by_state.get(key)
        if not uses:
            return
        state = data.view(torch.float32)
        for param_key, state_offset, param_offset, count in uses:
            built = self._built.get(param_key)
            if built is None:
                dtype, shape, _ = self._wanted[param_key]
                built = torch.empty(math.prod(shape), dtype=dtype)
                self._built[param_key] = built
            built[param_offset : param_offset + count].copy_(
                state[state_offset : state_offset + count]
            )
        self._fed.add(key)

    def finish(self) -> dict[str, torch.Tensor]:
        """The rebuilt parameters, manager key → tensor of the recorded shape.

        Raises:
            SnapshotDamagedError: a rebuilt parameter's bytes differ from those recorded
                when the snapshot was taken (names the file and the parameter).
        """
        missing = sorted(set(self._by_state) - self._fed)
        if missing:  # (every state key is named, so _check feeds it: a bug otherwise)
            raise SnapshotDamagedError(f"{self._where}: state tensors {missing} were not read")
        out: dict[str, torch.Tensor] = {}
        for key, (dtype, shape, expected) in self._wanted.items():
            built = self._built.get(key, torch.empty(0, dtype=dtype))
            actual = content_hash(built)
            if actual != expected:
                name = key.removeprefix(_PARAM + "param/")
                raise SnapshotDamagedError(
                    f"{self._where}: parameter {name!r} rebuilt from "
                    f"its fp32 master has xxh3_64 {actual:016x}, not {expected:016x} as when "
                    "the snapshot was taken"
                )
            out[key.removeprefix(_PARAM)] = built.view(shape)
        return out


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def register_rebuilt(manager: TierManager, rebuilt: Mapping[str, torch.Tensor]) -> None:
    """Register each rebuilt parameter as a 16-bit parameter (dirty in memory, as when
    the snapshot was taken; or written, where no memory tier has room).

    Raises:
        what :meth:`TierManager.register` raises.
    """
    for key, tensor in rebuilt.items():
        manager.register(key, tensor, Kind.PARAM16)
