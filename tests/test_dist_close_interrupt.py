"""A Ctrl-C while a sharded model closes (``ShardedModel.close``: gathers started ahead
waited for, then the manager closed) must not leave its store locked: close() marked
itself closed first, so a second close() was a no-op and the next ``swapper.offload``
on that directory failed with StoreLockedError. On 2 gloo ranks, a SIGINT is raised at
the n-th wait point of the close on every rank alike (the hook of
tests/test_exit_interrupt.py), with a gather of the read-ahead still in flight; then
close() again, and a new wrap of the same directories.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from sigint_cut import SigintAt as _Cut

#: wait points: a cut past these is not tried (the close has fewer)
MAX_CUTS = 12


def _close_cut(swap: str, at: int | str | None) -> dict[str, Any]:
    """Wrap, stop a forward half-way (a read-ahead gather left in flight), close with the
    cut armed; then close again and wrap the same directory anew."""
    import dist_ckpt_train
    import torch.distributed as dist

    import swapper
    from tiers import signals

    gpt = dist_ckpt_train.model()
    wrapped = swapper.offload(gpt, dist_ckpt_train.config(swap), dist.group.WORLD)
    in_flight = len(dist_ckpt_train.leave_gathers_in_flight(wrapped, gpt))
    cut = _Cut(at if isinstance(at, int) else None)
    if at == "manager":  # a Ctrl-C as the manager's close begins (its store still locked)
        real = wrapped.core.manager.close

        def cut_close(*args: Any, **kwargs: Any) -> None:
            wrapped.core.manager.close = real  # type: ignore[method-assign]
            cut.hit = "manager.close"
            signal.raise_signal(signal.SIGINT)
            real(*args, **kwargs)

        wrapped.core.manager.close = cut_close  # type: ignore[method-assign]
    if at == "collective":  # a Ctrl-C in the wait of a gather: the group marked failed,
        # the collective left unwaited (the next wait raises at once)
        from swapper.distributed import collectives

        real_wait = collectives.wait_work

        def cut_wait(dg: Any, work: Any, collective: str, what: str) -> None:
            collectives.wait_work = real_wait
            cut.hit = "wait_work"
            dg._failed.append(f"{collective} for {what} interrupted (test)")
            raise KeyboardInterrupt

        collectives.wait_work = cut_wait
    previous = signals.set_wait_hook(cut)
    raised = ""
    try:
        wrapped.close()
    except KeyboardInterrupt:
        raised = "KeyboardInterrupt"
    finally:
        signals.set_wait_hook(previous)
    # a cut gather is kept, its buffer with it (never freed with the collective in flight)
    left = sum(s.pending is not None for s in wrapped._states.values())
    wrapped.close()  # finishes a cut close
    again = swapper.offload(dist_ckpt_train.model(), dist_ckpt_train.config(swap), dist.group.WORLD)
    again.close()
    return {
        "passed": cut.passed,
        "hit": cut.hit,
        "raised": raised,
        "in_flight": in_flight,
        "left": left,
    }


def _every_cut(rank: int, world: int, tmp: str) -> list[dict[str, Any]]:
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        runs = [_close_cut(str(Path(tmp, f"rank{rank}", "clean")), None)]
        for at in range(1, min(len(runs[0]["passed"]), MAX_CUTS) + 1):
            runs.append(_close_cut(str(Path(tmp, f"rank{rank}", f"cut{at}")), at))
        runs.append(_close_cut(str(Path(tmp, f"rank{rank}", "cut-collective")), "collective"))
        runs.append(_close_cut(str(Path(tmp, f"rank{rank}", "cut-manager")), "manager"))
        return runs
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_at_each_wait_of_a_sharded_close_leaves_the_store_reusable(
    tmp_path: Path,
) -> None:
    import dist_ckpt_train

    ranks = dist_ckpt_train.values(dist_ckpt_train.spawn(_every_cut, 2, tmp_path, join_s=150))
    for runs in ranks:
        clean, cuts = runs[0], runs[1:]
        assert clean["raised"] == ""
        assert clean["in_flight"] > 0, "no gather in flight at close: nothing is tested"
        assert "gather" in clean["passed"], clean["passed"]
        assert cuts, "no wait point in the close: nothing is tested"
        for run in cuts:
            if run["hit"] is not None:
                assert run["raised"] == "KeyboardInterrupt", run
            if run["hit"] == "gather":
                assert run["left"] >= 1, run
        assert cuts[-2]["hit"] == "wait_work", cuts[-2]
        assert cuts[-2]["left"] >= 1, cuts[-2]  # kept until settled by the next close
        assert cuts[-1]["hit"] == "manager.close", cuts[-1]
    print([(r["hit"], r["raised"]) for r in ranks[0]])
