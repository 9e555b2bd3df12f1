"""tensorflow-datasets as a source: one split loaded in one call, failing in one line.

tfds has no option for how long it retries a download, nor for its progress bars: offline a
load took minutes and ~20 lines before its error. fail_fast_downloads sets both through tfds'
internals (`downloader.MAX_RETRIES`, `tqdm_utils`), only where they are the layout it knows,
and only for the duration of a load; this module is the one place that touches them.
"""
import contextlib
import io
import logging
import socket
import sys

import numpy as np

from capsnet.errors import DataError


# tfds retries each URL 10 times with exponential backoff, so offline it takes minutes
# to report that there is no network. Two retries ride out a transient failure and
# give up within a second or two when there is no network at all.
_TFDS_MAX_RETRIES = 2


@contextlib.contextmanager
def quiet_tfds():
    """For the duration of an attempt that falls back to a bundled sample: tfds' own lines
    kept off the terminal (its "Downloading and preparing dataset ..." print on stdout, absl's
    warnings such as "Variant folder ... has no dataset_info.json"), which offline came before
    the sample's notice and said nothing it does not. What tfds printed is said after a
    success (online, the download it made); after a failure it is dropped."""
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        absl_log.setLevel(level)
    sys.stdout.write(printed.getvalue())


def load_tfds(name, spec, split, tfds_data_dir):
    """tensorflow-datasets' `split` of dataset `name` (its DatasetSpec `spec`): uint8 images,
    labels and where they came from; DataError (one line) where tfds cannot provide it."""
    offline = ("point data.dir=/path/to/idx at a directory of IDX files "
               "(train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-…)")
    if spec.tfds_name is None:
        raise DataError(f"dataset {name} is not in tensorflow-datasets: {offline}")
    try:
        import tensorflow_datasets as tfds  # slow to import; only this path needs it
    except ImportError as err:
        raise DataError(f"tensorflow-datasets cannot be imported ({err}): install it, or "
                        f"{offline}") from err
    source = f"{spec.tfds_name}/{split}"
    try:
        with fail_fast_downloads():
            images, labels = tfds.load(spec.tfds_name, split=split, as_supervised=True,
                                       batch_size=-1, data_dir=tfds_data_dir)
    except ImportError as err:
        # A dependency tfds forgot to declare (e.g. importlib_resources with
        # tensorflow-datasets 4.9.10) fails only once it prepares a dataset.
        raise DataError(f"tensorflow-datasets cannot prepare {source}: a module it needs is "
                        f"missing ({err}; pip install {err.name or 'it'}); or, offline, "
                        f"{offline}") from err
    except Exception as err:  # tfds raises many types (requests, OSError, AssertionError, ...)
        if is_network_error(err):
            # The cause (a urllib3 retry report, hundreds of characters) says no more than this.
            raise DataError(f"could not download {spec.tfds_name} with tensorflow-datasets (no network); "
                            f"offline, use data.dir=/path/to/idx (a directory of the IDX files "
                            f"train-images-idx3-ubyte.gz, t10k-…)") from err
        reason = shorten((str(err).strip().splitlines() or [""])[0], 160)
        raise DataError(f"tensorflow-datasets could not download or prepare {source} "
                        f"({type(err).__name__}: {reason}); offline, {offline}") from err
    return np.asarray(images), np.asarray(labels), f"tensorflow-datasets {source}"


@contextlib.contextmanager
def fail_fast_downloads():
    """For the duration: lowers tfds' per-URL retry count (see _TFDS_MAX_RETRIES), and
    keeps tfds' progress bars and urllib3's retry warnings off the terminal; offline they
    were ~20 lines burying the one-line error. tfds still prints what it downloads.
    After a failed download urllib3 stays at ERROR (see the end)."""
    with contextlib.ExitStack() as stack:
        # tfds' internals, not its API (it offers neither setting): a module-level retry
        # count and its progress-bar switch, each changed only where it is the type this
        # code knows, and put back by the ExitStack however the load ends.
        try:
            from tensorflow_datasets.core.download import downloader
        except ImportError:
            downloader = None
        old = getattr(downloader, "MAX_RETRIES", None)
        if old is not None:  # else another tfds layout: leave it alone
            downloader.MAX_RETRIES = min(old, _TFDS_MAX_RETRIES)
            stack.callback(setattr, downloader, "MAX_RETRIES", old)
        try:
            from tensorflow_datasets.core.utils import tqdm_utils
        except ImportError:
            tqdm_utils = None
        if isinstance(getattr(tqdm_utils, "_active", None), bool):
            stack.callback(tqdm_utils.display_progress_bar, tqdm_utils._active)
            tqdm_utils.display_progress_bar(False)
        urllib3_log = logging.getLogger("urllib3")
        level = urllib3_log.level
        urllib3_log.setLevel(logging.ERROR)
        yield
        # Restored only after a success: after a failure tfds' download threads go on
        # retrying (and warning) in the background while the error is reported.
        urllib3_log.setLevel(level)


def is_network_error(err):
    """Whether `err`, or an exception it was raised from, is a failure to reach the server
    (no network, DNS, proxy, timeout)."""
    network = [ConnectionError, TimeoutError, socket.gaierror]
    try:
        import requests

        network += [requests.exceptions.ConnectionError, requests.exceptions.Timeout]
    except ImportError:
        pass
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, tuple(network)):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def shorten(text, limit):
    """`text` cut at a word boundary to at most `limit` characters (… marks a cut)."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(" ,:;(") + " …"

