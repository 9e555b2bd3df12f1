"""Argument checks shared by the layers, the routing math, the data pipeline and the config.

Every check raises `error(f"{name} must be {expected}, got {value!r}")` and returns the
value in its plain Python type. `name` is what the user should look for, so callers put
their context in it ("DigitCaps: num_caps", "train.epochs"). `error` is ValueError by
default (Keras layers and the math raise it); the config layer passes ConfigError so the
entry points print one line and exit 2. `expected` overrides the wording where a
caller's message says more (e.g. what null means there).

No TensorFlow here: scripts/benchmark_train.py parses its arguments with these before
importing anything heavy.
"""

import math
import numbers

__all__ = ["boolean", "finite_float", "float_in_range", "integer", "positive_float", "positive_int", "positive_int_tuple"]


def _is_int(value):
    # bool is an int subclass, but `True` filters is a typo, not a count; NumPy integers
    # are numbers.Integral, np.bool_ is not.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def positive_int(name, value, *, allow_none=False, expected=None, error=ValueError):
    """`value` as an int ≥ 1 (None passes through when `allow_none`)."""
    if value is None and allow_none:
        return None
    if not _is_int(value) or value < 1:
        if expected is None:
            expected = "a positive integer" + (" or null" if allow_none else "")
        raise error(f"{name} must be {expected}, got {value!r}")
    return int(value)


def integer(name, value, *, minimum=None, maximum=None, hint="", error=ValueError):
    """`value` as an int within [minimum, maximum] (either bound may be None); `hint` is
    appended to the message."""
    if not _is_int(value):
        raise error(f"{name} must be an integer, got {value!r}{hint}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f"≥ {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise error(f"{name} must be {bounds}, got {value}{hint}")
    return value


def positive_float(name, value, *, expected="a positive number", error=ValueError):
    """`value` as a float > 0 (NaN fails; inf passes)."""
    if not _is_real(value) or not value > 0:
        raise error(f"{name} must be {expected}, got {value!r}")
    return float(value)


def finite_float(name, value, *, expected="a finite number", error=ValueError):
    """`value` as a finite float (no NaN, no ±inf)."""
    if not _is_real(value) or not math.isfinite(value):
        raise error(f"{name} must be {expected}, got {value!r}")
    return float(value)


def float_in_range(name, value, low, high, *, error=ValueError):
    """`value` as a float in [low, high] (ints pass; bools and NaN fail)."""
    if not _is_real(value) or not low <= value <= high:
        raise error(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def boolean(name, value, *, expected="true or false", error=ValueError):
    """`value` if it is a real bool: Hydra passes `custom_op=no` as the string 'no',
    which bool() would read as True, and 1 / 0 are more likely typos than flags."""
    if not isinstance(value, bool):
        raise error(f"{name} must be {expected}, got {value!r}")
    return value


def positive_int_tuple(name, value, *, length=None, error=ValueError):
    """`value` as a tuple of ints ≥ 1: exactly `length` of them, or any non-empty number
    when `length` is None. A single int is repeated `length` times (kernel_size=9 →
    (9, 9))."""
    if _is_int(value):
        value = (value,) * (length or 1)
    try:
        items = tuple(value)
    except TypeError:
        raise error(f"{name} must be a sequence of positive integers, got {value!r}") from None
    if not items or (length is not None and len(items) != length) or not all(
        _is_int(x) and x >= 1 for x in items
    ):
        what = f"{length} positive integers" if length else "a non-empty sequence of positive integers"
        raise error(f"{name} must be {what}, got {value!r}")
    return tuple(int(x) for x in items)
