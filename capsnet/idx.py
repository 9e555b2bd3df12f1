"""The IDX file format of the MNIST-family distributions: `read_idx` / `write_idx` (plain
or gzip), and `idx_file_names`, the files a split is stored in. NumPy only, no TensorFlow;
capsnet.data.load_split reads a directory of these files.
"""
import gzip
import math
import os
import struct
import zlib

import numpy as np

from capsnet.errors import DataError

# --------------------------------------------------------------------------- format
# An IDX file is a 4-byte magic (0x00, 0x00, type code, rank), `rank` big-endian uint32
# dims, then the C-order payload in big-endian. MNIST images are 0x00000803 (uint8,
# rank 3: N, rows, cols), labels 0x00000801 (uint8, rank 1: N).
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {dtype.newbyteorder("="): code for code, dtype in _IDX_DTYPES.items()}
_GZIP_MAGIC = b"\x1f\x8b"  # an IDX file starts with 0x0000, so this cannot be one


def read_idx(path):
    """Reads an IDX file, plain or gzip (told apart by the first bytes, not the name).

    Returns an array in native byte order with the header's dtype and shape. Any
    inconsistency (unreadable file, corrupt gzip, bad magic, unknown type code, a
    header or payload shorter or longer than the header says) raises `DataError`
    naming the file and the problem.
    """
    path = os.fspath(path)
    raw = _read_bytes(path)
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as err:
            # EOFError: the gzip stream was cut off; OSError/zlib.error: bad data.
            raise DataError(f"IDX file {path}: corrupt or truncated gzip data ({err})") from err

    if len(raw) < 4:
        raise DataError(f"IDX file {path}: truncated header ({len(raw)} bytes, need at least 4)")
    magic = struct.unpack(">I", raw[:4])[0]
    if raw[0] != 0 or raw[1] != 0:
        raise DataError(
            f"IDX file {path}: bad magic 0x{magic:08x} (IDX magic is 0x0000 + type code + rank, "
            f"e.g. 0x00000803 for images, 0x00000801 for labels)")
    code, rank = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        known = ", ".join(f"0x{c:02x}" for c in _IDX_DTYPES)
        raise DataError(f"IDX file {path}: unknown type code 0x{code:02x} in magic 0x{magic:08x} "
                        f"(known: {known})")
    if rank == 0:
        raise DataError(f"IDX file {path}: rank 0 in magic 0x{magic:08x} (need at least 1 dim)")

    header_len = 4 + 4 * rank
    if len(raw) < header_len:
        raise DataError(f"IDX file {path}: truncated header ({len(raw)} bytes, rank {rank} "
                        f"needs {header_len})")
    dims = struct.unpack(f">{rank}I", raw[4:header_len])
    dtype = _IDX_DTYPES[code]
    count = math.prod(dims)
    expected, actual = count * dtype.itemsize, len(raw) - header_len
    if actual < expected:
        raise DataError(f"IDX file {path}: truncated payload (header says shape {dims} of "
                        f"{dtype.newbyteorder('=').name}: {expected} bytes, file has {actual})")
    if actual > expected:
        raise DataError(f"IDX file {path}: {actual - expected} bytes after the payload that "
                        f"header shape {dims} describes (corrupt header?)")
    array = np.frombuffer(raw, dtype=dtype, count=count, offset=header_len).reshape(dims)
    return array.astype(dtype.newbyteorder("="))  # a writable native-order copy


def _read_bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError as err:
        raise DataError(f"IDX file {path} does not exist") from err
    except IsADirectoryError as err:
        raise DataError(f"IDX file {path} is a directory, not a file") from err
    except OSError as err:
        raise DataError(f"cannot read IDX file {path}: {err.strerror or err}") from err


def write_idx(path, array):
    """Writes `array` as an IDX file; gzip-compressed when `path` ends in `.gz`.

    Supported dtypes: uint8, int8, int16, int32, float32, float64 (the IDX types).
    """
    path = os.fspath(path)
    array = np.asarray(array)
    code = _IDX_CODES.get(array.dtype.newbyteorder("="))
    if code is None:
        names = ", ".join(d.name for d in _IDX_CODES)
        raise DataError(f"cannot write IDX file {path}: dtype {array.dtype} has no IDX type "
                        f"(supported: {names})")
    if not 1 <= array.ndim <= 255 or any(d >= 2**32 for d in array.shape):
        raise DataError(f"cannot write IDX file {path}: shape {array.shape} does not fit IDX "
                        f"(rank 1..255, dims < 2**32)")
    header = bytes((0, 0, code, array.ndim)) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + np.ascontiguousarray(array, dtype=_IDX_DTYPES[code]).tobytes()
    if path.endswith(".gz"):
        data = gzip.compress(data, mtime=0)  # mtime=0: the same array gives the same bytes
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as err:
        raise DataError(f"cannot write IDX file {path}: {err.strerror or err}") from err


# --------------------------------------------------------------------------- file names
# split → IDX file-name prefix (the MNIST distribution calls the test split "t10k").
_IDX_PREFIX = {"train": "train", "test": "t10k"}
SPLITS = tuple(_IDX_PREFIX)  # the splits of the distribution, as load_split names them


def idx_file_names(split):
    """The (images, labels) IDX base names of `split`; each may also end in `.gz`."""
    prefix = _IDX_PREFIX[split]
    return f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"


def idx_files(data_dir, split):
    """The (images, labels) files of `split` in `data_dir`, each a list of the one or two found
    (`base` and `base.gz`): DataError naming the directory where it is not one or lacks a
    file. The paths alone (no file read): the config check calls it before the TensorFlow
    import, the data loader before it reads them."""
    data_dir = os.path.abspath(os.path.expanduser(os.fspath(data_dir)))
    bases = idx_file_names(split)
    if not os.path.isdir(data_dir):
        expected = ", ".join(f"{b}[.gz]" for s in SPLITS for b in idx_file_names(s))
        raise DataError(f"data dir {data_dir} does not exist or is not a directory "
                        f"(it should hold the IDX files {expected})")
    found = []
    for base in bases:
        candidates = [os.path.join(data_dir, base + suffix) for suffix in ("", ".gz")]
        found.append([p for p in candidates if os.path.isfile(p)])
        if not found[-1]:
            raise DataError(f"data dir {data_dir} has no {base} or {base}.gz "
                            f"(the {split} split needs {bases[0]}[.gz] and {bases[1]}[.gz])")
    return found
