"""The RNG states a training snapshot records and a resume restores (torch CPU and CUDA),
as base64 text in the snapshot's JSON metadata (:mod:`swapper.zero.checkpoint.snapshot`)."""

from __future__ import annotations

import base64
import binascii
import logging
from typing import Any

import torch

from tiers.nvme.snapshots import SnapshotDamagedError

__all__ = ["decode_rng", "rng_state", "set_rng_state"]

log = logging.getLogger("swapper.zero.checkpoint.snapshot")


def rng_state() -> dict[str, Any]:
    """This process's torch RNG states: ``{"cpu": base64, "cuda": [base64 per device]}``."""
    cuda: list[str] = []
    if torch.cuda.is_available():
        cuda = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return {"cpu": _b64(torch.get_rng_state()), "cuda": cuda}


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


#: byte lengths torch accepts for one CUDA (Philox) generator state: seed + offset
#: (8 + 8), or the seed alone (older snapshots); get_rng_state() gives the former
_CUDA_STATE_NBYTES = (16, 8)


def decode_rng(raw: object, where: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The states :func:`rng_state` recorded, as uint8 tensors (CPU, then per device),
    checked so that :func:`set_rng_state` cannot fail on them: the CPU state is tried on
    a scratch generator (its byte length and mt19937 content, as this torch expects),
    each CUDA state's byte length is checked (no device is needed for that).

    Raises:
        SnapshotDamagedError: ``raw`` is not such a record, or a state is not one torch
            takes (names ``where`` and what is wrong).
    """
    if (
        not isinstance(raw, dict)
        or raw.keys() != {"cpu", "cuda"}
        or not isinstance(raw["cuda"], list)
    ):
        raise SnapshotDamagedError(f"{where}: rng is not {{'cpu': ..., 'cuda': [...]}}")

    def one(text: object) -> torch.Tensor:
        if not isinstance(text, str):
            raise SnapshotDamagedError(f"{where}: an RNG state is not a string")
        try:
            data = base64.b64decode(text.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise SnapshotDamagedError(f"{where}: an RNG state is not base64") from None
        if not data:  # frombuffer refuses an empty buffer (ValueError)
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    cpu = one(raw["cpu"])
    try:  # a scratch generator: this process's RNG is untouched if the state is bad
        torch.Generator().set_state(cpu)
    except RuntimeError as e:  # torch's words say what is wrong (size or content)
        raise SnapshotDamagedError(f"{where}: the CPU RNG state is not valid: {e}") from None
    cuda = [one(t) for t in raw["cuda"]]
    for device, state in enumerate(cuda):
        if state.numel() not in _CUDA_STATE_NBYTES:
            raise SnapshotDamagedError(
                f"{where}: the CUDA RNG state of device {device} has {state.numel()} "
                f"bytes, not {' or '.join(map(str, _CUDA_STATE_NBYTES))}"
            )
    return cpu, cuda


def set_rng_state(states: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    """Set the CPU state, and the CUDA states when this machine has as many devices
    (else logged, not restored)."""
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning(
                "resume: the snapshot has %d CUDA RNG states, this machine %d devices: "
                "CUDA RNG not restored",
                len(cuda),
                torch.cuda.device_count(),
            )
