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


def say(line, *, stream=None):
    """Print `line` (stdout unless `stream`) and append it to the job's log files."""
    stream = stream or sys.stdout
    stream.write(line + "\n")
    stream.flush()
    if not _log_files():
        return
    record = logging.LogRecord("capsnet", logging.ERROR if stream is sys.stderr else logging.INFO,
                               __file__, 0, line, None, None)
    for handler in _log_files():
        handler.handle(record)
