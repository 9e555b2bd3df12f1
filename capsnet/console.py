"""What the user sees on the terminal, also in the run's log file.

train.py's epoch lines and its one-line errors are written to the terminal as they are
(no logging prefixes), and, where Hydra has set up its job logging, also to the run
directory's train.log through the root logger's file handlers: the log holds what the
user saw. Outside Hydra (train() from Python, tests) there are no such handlers.
"""
import logging
import sys


def _log_files():
    return [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


# Whether a live progress bar's line (redrawn in place, no newline yet) ends the terminal's
# output: a line said now starts on a line of its own, not after the bar's last number.
_bar_line_open = False


def bar_line_open(is_open):
    """Called by the live progress bar: True after it drew a line it will redraw."""
    global _bar_line_open
    _bar_line_open = is_open


def say(line, *, stream=None):
    """Print `line` (stdout unless `stream`) and append it to the job's log files."""
    global _bar_line_open
    stream = stream or sys.stdout
    if _bar_line_open:
        _bar_line_open = False
        sys.stdout.write("\n")  # the bar's line ends; its next redraw starts below this one
        sys.stdout.flush()
    stream.write(line + "\n")
    stream.flush()
    if not _log_files():
        return
    record = logging.LogRecord("capsnet", logging.ERROR if stream is sys.stderr else logging.INFO,
                               __file__, 0, line, None, None)
    for handler in _log_files():
        handler.handle(record)


def count(n, noun):
    """'1 epoch', '2 epochs', '0 epochs': `n` and `noun`, plural unless n is 1."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
