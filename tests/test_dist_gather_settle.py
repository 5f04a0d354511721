"""A gather's buffers are never freed while its collective may still write into them.

``ShardedModel.drain()`` (the optimizer's first write waits for the gathers started
ahead) and the forward pre-hook's ``Gathers.acquire`` used to free a gather's buffers (give its
device blocks back to the budget, for the next reservation to reuse) as soon as its wait
raised an ordinary error, although a wait that raises leaves the collective unwaited (a
group that failed earlier raises at once; torch.distributed's async work may still be
writing into the buffer). On 2 gloo ranks (every collective under the 20 s group timeout
of tests/dist_ckpt_train.py), read-ahead gathers are left in flight by a forward stopped
half-way, the group is marked failed, and every free of a gather's block is checked to
come after its collective was settled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _frees_after_settle(rank: int, world: int, tmp: str, path: str) -> dict[str, Any]:
    """Wrap, leave gathers in flight, fail the group, then ``path`` ("drain" or
    "acquire"); return what was freed while unsettled and the error raised."""
    import dist_ckpt_train
    import torch.distributed as dist

    import swapper
    from swapper.distributed import CollectiveError

    gpt = dist_ckpt_train.model()
    swap = str(Path(tmp, f"rank{rank}", path))
    wrapped = swapper.offload(gpt, dist_ckpt_train.config(swap), dist.group.WORLD)
    in_flight = dist_ckpt_train.leave_gathers_in_flight(wrapped, gpt)
    budget = wrapped._budget
    unsettled: list[str] = []
    freed: list[str] = []
    real_release, real_waited = budget.release, budget.waited

    def check(pending: Any) -> None:
        if pending is not None:
            freed.append(pending.what)
            if pending._work is not None:  # the backend may still write into it
                unsettled.append(pending.what)

    def release(pending: Any) -> None:
        check(pending)
        real_release(pending)

    def waited(pending: Any) -> None:
        check(pending)
        real_waited(pending)

    budget.release = release  # type: ignore[method-assign]
    budget.waited = waited  # type: ignore[method-assign]
    # an earlier collective failed: a wait raises at once, its collective left unwaited
    wrapped.group._failed.append("an earlier collective failed (test)")
    raised = ""
    try:
        if path == "drain":
            wrapped.drain()
        else:
            wrapped.fetch.acquire(in_flight[0])
    except CollectiveError as exc:
        raised = f"CollectiveError: {exc}"
    budget.release, budget.waited = real_release, real_waited  # type: ignore[method-assign]
    left = sum(s.pending is not None for s in wrapped._states.values())
    charged = budget.charged_nbytes
    wrapped.close()
    return {
        "in_flight": len(in_flight),
        "unsettled": unsettled,
        "freed": freed,
        "raised": raised,
        "left": left,
        "charged_after_close": budget.charged_nbytes,
        "charged": charged,
    }


def _both(rank: int, world: int, tmp: str) -> list[dict[str, Any]]:
    return [_frees_after_settle(rank, world, tmp, p) for p in ("drain", "acquire")]


def test_a_failed_gather_is_settled_before_its_buffers_are_freed(tmp_path: Path) -> None:
    import dist_ckpt_train

    ranks = dist_ckpt_train.values(dist_ckpt_train.spawn(_both, 2, tmp_path, join_s=120))
    for runs in ranks:
        for run in runs:
            assert run["in_flight"] > 0, "no gather in flight: nothing is tested"
            assert run["raised"].startswith("CollectiveError"), run
            assert run["freed"], run  # the failed gather's buffers were freed ...
            assert run["unsettled"] == [], run  # ... only after its collective settled
            assert run["charged_after_close"] == 0, run
