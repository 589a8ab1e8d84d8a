"""A parameter value as mergekit 0.1.5 reads it: the coercions of its validation, exactly.

mergekit keeps a parameter's YAML value as it is (a bool, int, float or str) until the method
validates it with pydantic's lax mode against the parameter's type (``bool``, ``float``, ``int``
or ``Optional[float]``). So ``normalize: 1.0`` is true, ``tol: 1e-5`` (a string to PyYAML: no
dot) is ``1e-05`` and ``max_iter: 3.0`` is ``3``, while ``normalize: 0.5`` and ``max_iter: 0.5``
are refused. :func:`coerce` applies the same rules (written from their observed behaviour,
pinned by tests/spec/test_param_values.py against mergekit itself):

- bool: a bool; the int or float 0 or 1; the strings ``0`` and ``1``, and, ignoring ASCII case,
  ``f n no off false`` and ``t y on yes true`` (no surrounding spaces);
- float: a bool (0.0, 1.0), an int, a float, or a string: Unicode whitespace around it is
  dropped, then ``[+-]`` and digits with an optional ``.`` and exponent, or ``inf``,
  ``infinity``, ``nan`` (any case); failing that, the unstripped string with single ``_``
  between characters removed (none first or last) is tried once more;
- int: a bool (0, 1), an int, a float that is whole and strictly inside the int64 range, or a
  string: whitespace dropped, one leading ``+`` or ``-`` (not both), leading zeros dropped
  (with ``_`` among them; pydantic's parser then also takes a ``-`` after them: ``0-1`` is -1),
  a ``.`` followed only by zeros (at least one) cut off, single ``_`` removed as above, and
  what is left an integer of at most 4300 digits.

Pure; any thread.
"""

from __future__ import annotations

import re
from typing import Any

_WHITESPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
               "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")  # Unicode White_Space
_FLOAT = re.compile(r"[+-]?(?:inf|infinity|nan|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)",
                    re.IGNORECASE | re.ASCII)
_JSON_INT = re.compile(r"-?(?:0|[1-9][0-9]*)", re.ASCII)
_FALSE = frozenset({"f", "n", "no", "off", "false"})
_TRUE = frozenset({"t", "y", "on", "yes", "true"})
_INT_DIGITS_MAX = 4300  # mergekit's (pydantic's) limit on the length of an integer string
_I64 = 2.0 ** 63

#: what each kind accepts, for error messages
EXPECTED = {
    "bool": "true or false (or 1/0, yes/no, on/off)",
    "float": "a number",
    "float?": "a number",
    "int": "an integer",
}


def _without_underscores(text: str) -> str | None:
    if "_" not in text or text.startswith("_") or text.endswith("_") or "__" in text:
        return None
    return text.replace("_", "")


def _float_text(text: str) -> float | None:
    stripped = text.strip(_WHITESPACE)
    if _FLOAT.fullmatch(stripped):
        return float(stripped)
    joined = _without_underscores(text)  # on the text as given: no spaces around it then
    if joined is not None and _FLOAT.fullmatch(joined):
        return float(joined)
    return None


def _leading_zeros_dropped(text: str) -> str | None:
    """``text`` from its first significant character: zeros (and ``_`` after the first zero)
    dropped, but the last zero before a ``.`` or of an all-zero text; None if it does not
    start like a number."""
    if not text or (text[0] not in "0123456789-"):
        return None
    if text[0] != "0":
        return text
    for i, c in enumerate(text):
        if c in "0_":
            continue
        if c in "123456789-":
            return text[i:]
        return text[i - 1:] if c == "." else None
    return text[-1:]


def _int_text(text: str) -> int | None:
    stripped = text.strip(_WHITESPACE)
    if stripped.startswith("+"):
        stripped = stripped[1:]
        if stripped.startswith("-"):
            return None
    sign = ""
    if stripped.startswith("-"):
        stripped, sign = stripped[1:], "-"
        if stripped[:1] in ("-", "+"):
            return None
    rest = _leading_zeros_dropped(stripped)
    if rest is None:
        return None
    dot = rest.find(".")
    if dot >= 0 and len(rest) > dot + 1 and set(rest[dot + 1:]) == {"0"}:
        rest = rest[:dot]
    rest = sign + (_without_underscores(rest) or rest)
    if not _JSON_INT.fullmatch(rest) or len(rest.lstrip("-")) > _INT_DIGITS_MAX:
        return None
    return int(rest)


def _bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value) if value in (0, 1) else None
    if isinstance(value, str):
        if value == "0" or (value.isascii() and value.lower() in _FALSE):
            return False
        if value == "1" or (value.isascii() and value.lower() in _TRUE):
            return True
    return None


def _float(value: Any) -> float | None:
    if isinstance(value, (bool, int, float)):
        try:
            return float(value)
        except OverflowError:  # an int beyond float's range
            return None
    if isinstance(value, str):
        return _float_text(value)
    return None


def _int(value: Any) -> int | None:
    if isinstance(value, (bool, int)):
        return int(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")) or value % 1.0 != 0.0:
            return None
        return int(value) if -_I64 < value < _I64 else None
    if isinstance(value, str):
        return _int_text(value)
    return None


_COERCE = {"bool": _bool, "float": _float, "float?": _float, "int": _int}


def coerce(kind: str, value: Any) -> Any:
    """``value`` as a parameter of ``kind`` ("bool", "float", "int", "float?") after mergekit's
    coercions; raises ValueError (what was expected) when mergekit refuses it. ``None`` stays
    ``None`` for "float?" (mergefs' own "no value"; mergekit's YAML cannot say it)."""
    if kind == "float?" and value is None:
        return None
    out = _COERCE[kind](value)
    if out is None:
        raise ValueError(f"expected {EXPECTED[kind]}, got {value!r}")
    return out
