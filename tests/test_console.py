"""capsnet.console.say: a line said while a live progress bar's line is open starts on a
line of its own (the bar redraws in place with a carriage return and no newline)."""
import io
import sys

from capsnet import console


def test_a_line_said_after_a_live_bar_starts_on_its_own_line(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    out.write("\r 3/10 [=====>....] - loss: 0.5")  # the bar, as keras' Progbar draws it
    console.bar_line_open(True)
    console.say("estimated time of the run: 2 min")
    console.say("epoch 1: done")  # the bar's line was ended once, not before every line
    assert out.getvalue() == "\r 3/10 [=====>....] - loss: 0.5\nestimated time of the run: 2 min\nepoch 1: done\n"


def test_without_an_open_bar_lines_are_written_as_they_are(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    console.bar_line_open(False)
    console.say("a")
    assert out.getvalue() == "a\n"


def test_a_count_is_singular_for_one_only():
    assert [console.count(n, "epoch") for n in (0, 1, 2)] == ["0 epochs", "1 epoch", "2 epochs"]
