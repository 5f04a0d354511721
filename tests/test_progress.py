"""swapper.progress: a line per finished item; a bar on a terminal only."""

from __future__ import annotations

import pytest

from swapper.progress import Progress


def test_plain_lines_without_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress(3, "tool", "item") as progress:  # (stdout captured: not a terminal)
        assert not progress.has_bar
        for i in range(3):
            progress.done(f"item {i}")
    out, err = capsys.readouterr()
    assert out.splitlines() == ["item 0", "item 1", "item 2"] and err == ""


def test_a_bar_on_stderr_with_the_lines_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress(2, "tool", "item", bar=True) as progress:
        assert progress.has_bar
        progress.done("first")
        progress.done("second")
    assert not progress.has_bar  # closed with the block
    out, err = capsys.readouterr()
    assert out.splitlines() == ["first", "second"]
    assert "tool:" in err and "/2 [" in err  # (tqdm redraws at most every 0.1 s)


def test_no_bar_when_told_or_for_one_item(capsys: pytest.CaptureFixture[str]) -> None:
    for total, bar in ((5, False), (1, True)):
        with Progress(total, "tool", "item", bar=bar) as progress:
            assert not progress.has_bar
            progress.done("x")
    assert capsys.readouterr().err == ""
