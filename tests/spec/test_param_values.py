"""Parameter values as mergekit 0.1.5 reads them (mergefs.methods.values): the coercions of its
validation (pydantic's lax mode), value by value against mergekit's own parameter validation, and
what the spec records."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings as hsettings, strategies as st

from mergefs.core.errors import SpecError
from mergefs.methods.base import ParamDef, Scope
from mergefs.methods.values import coerce
from mergefs.spec import settings
from mergefs.spec.load import load_spec

KINDS = ("bool", "float", "int", "float?")

# value -> per kind: the coerced value, or None when refused
TABLE: list[tuple[Any, dict[str, Any]]] = [
    (True, {"bool": True, "float": 1.0, "int": 1}),
    (0, {"bool": False, "float": 0.0, "int": 0}),
    (1.0, {"bool": True, "float": 1.0, "int": 1}),
    (-0.0, {"bool": False, "float": -0.0, "int": 0}),
    (0.5, {"bool": None, "float": 0.5, "int": None}),
    (2, {"bool": None, "float": 2.0, "int": 2}),
    (2.0 ** 63, {"bool": None, "float": 2.0 ** 63, "int": None}),
    ("1e-5", {"bool": None, "float": 1e-5, "int": None}),
    ("1E+05", {"bool": None, "float": 1e5, "int": None}),
    (" 0.5\t", {"bool": None, "float": 0.5, "int": None}),
    (".5", {"bool": None, "float": 0.5, "int": None}),
    ("5.", {"bool": None, "float": 5.0, "int": None}),
    ("3.00", {"bool": None, "float": 3.0, "int": 3}),
    ("1_000", {"bool": None, "float": 1000.0, "int": 1000}),
    ("1__0", {"bool": None, "float": None, "int": None}),
    ("_1", {"bool": None, "float": None, "int": None}),
    ("007", {"bool": None, "float": 7.0, "int": 7}),
    ("+3", {"bool": None, "float": 3.0, "int": 3}),
    ("0x10", {"bool": None, "float": None, "int": None}),
    ("1", {"bool": True, "float": 1.0, "int": 1}),
    ("0", {"bool": False, "float": 0.0, "int": 0}),
    ("1.0", {"bool": None, "float": 1.0, "int": 1}),
    ("Yes", {"bool": True, "float": None, "int": None}),
    ("off", {"bool": False, "float": None, "int": None}),
    ("T", {"bool": True, "float": None, "int": None}),
    (" true", {"bool": None, "float": None, "int": None}),
    ("yes please", {"bool": None, "float": None, "int": None}),
    ("", {"bool": None, "float": None, "int": None}),
    ("\u0661", {"bool": None, "float": None, "int": None}),  # a non-ASCII digit
    (None, {"bool": None, "float": None, "int": None}),
    ([1], {"bool": None, "float": None, "int": None}),
]


@pytest.mark.parametrize("value,expected", TABLE, ids=[repr(v) for v, _ in TABLE])
def test_coercions_of_each_kind(value: Any, expected: dict[str, Any]) -> None:
    for kind in ("bool", "float", "int"):
        want = expected[kind]
        if want is None:
            with pytest.raises(ValueError, match="expected"):
                coerce(kind, value)
        else:
            got = coerce(kind, value)
            assert type(got) is type(want) and got == want, (kind, value, got)
            if isinstance(want, float):
                assert math.copysign(1, got) == math.copysign(1, want)
    assert coerce("float?", None) is None  # mergefs' "no value"; float? is float otherwise


# -- against mergekit's own validation ------------------------------------------------------------

def _mergekit_validators() -> dict[str, Any]:
    pytest.importorskip("mergekit")
    from mergekit.merge_methods import registered_methods

    out: dict[str, Any] = {}
    for method in registered_methods():
        for p in method.spec.parameters:
            kind = {"bool": "bool", "float": "float", "int": "int"}.get(
                getattr(p.value_type, "__name__", ""), "float?")
            out.setdefault(kind, p.validate)
    assert set(out) == set(KINDS), out  # mergekit 0.1.5 has parameters of these four types
    return out


def _mergekit(validate: Any, value: Any) -> tuple[bool, Any]:
    try:
        return True, validate(value)
    except Exception:  # pydantic's ValidationError: refused
        return False, None


def _same(kind: str, value: Any, validators: dict[str, Any]) -> None:
    ok, want = _mergekit(validators[kind], value)
    try:
        got, mine = coerce(kind, value), True
    except ValueError:
        got, mine = None, False
    assert mine == ok, (kind, value, want)
    if ok:
        assert type(got) is type(want), (kind, value, got, want)
        assert got == want or (got != got and want != want), (kind, value, got, want)


NUMBER_TEXT = st.text(alphabet="0123456789._eE+- \t\u00a0\u3000\x1cinfatyo", max_size=8)


@hsettings(max_examples=3000, deadline=None)
@given(text=st.one_of(NUMBER_TEXT, st.text(max_size=6),
                      st.sampled_from(["true", "FALSE", "yes", "No", "on", "OFF", "t", "f",
                                       "y", "n", "1", "0", "nan", "-Infinity", "1e400",
                                       # pydantic's integer parser at its edges
                                       "0-1", "0_-1", "+0-1", "-0-1", "0__1", "-_1", "0_",
                                       "00.0", "0_5.00", "1.0_0", "+-1", "-+1", " 1_0 "])))
def test_strings_as_mergekit_validates_them(text: str) -> None:
    validators = _mergekit_validators()
    for kind in KINDS:
        _same(kind, text, validators)


@hsettings(max_examples=500, deadline=None)
@given(value=st.one_of(st.booleans(), st.integers(min_value=-2 ** 70, max_value=2 ** 70),
                       st.floats(), st.sampled_from([0.0, 1.0, -0.0, 2.0 ** 63, -2.0 ** 63,
                                                     2.0 ** 63 - 1024])))
def test_numbers_as_mergekit_validates_them(value: Any) -> None:
    validators = _mergekit_validators()
    for kind in KINDS:
        _same(kind, value, validators)


# -- in a spec: checked once, at the edge, recorded in normal form --------------------------------

def _spec(tmp_path: Path, text: str) -> Any:
    for d in ("base", "a", "b"):
        (tmp_path / d).mkdir(exist_ok=True)
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return load_spec(path)


def test_yaml_values_become_what_mergekit_reads(tmp_path: Path) -> None:
    spec = _spec(tmp_path, """
merge_method: ties
base_model: ./base
models:
  - {model: ./a, parameters: {weight: "0.5", density: 5e-1}}
  - {model: ./b, parameters: {weight: 1, density: [1e-1, 1]}}
parameters: {normalize: 1.0, int8_mask: "off", rescale: 1, lambda: 1e0}
""")
    assert spec.parameters["normalize"] is True and spec.parameters["rescale"] is True
    assert spec.parameters["int8_mask"] is False
    assert spec.parameters["lambda"] == 1.0 and type(spec.parameters["lambda"]) is float
    assert [e.parameters["weight"] for e in spec.experts] == [0.5, 1.0]
    assert spec.experts[0].parameters["density"] == 0.5
    assert spec.experts[1].parameters["density"] == [0.1, 1.0]
    # the resolved spec (the manifest's) holds the normal form, which loads to itself
    raw = spec.raw
    assert raw["parameters"]["normalize"] is True and raw["parameters"]["lambda"] == 1.0
    assert raw["models"][1]["parameters"]["density"] == [0.1, 1.0]
    again = _spec(tmp_path, yaml.safe_dump({**raw, "budget": "full"}))
    assert again.parameters == spec.parameters
    assert [e.parameters for e in again.experts] == [e.parameters for e in spec.experts]


def test_slice_values_are_recorded_in_normal_form(tmp_path: Path) -> None:
    spec = _spec(tmp_path, """
merge_method: karcher
slices:
  - sources:
      - {model: ./a, layer_range: [0, 2]}
      - {model: ./b, layer_range: [0, 2]}
    parameters: {tol: 1e-5, max_iter: "3.0"}
""")
    assert spec.raw["slices"][0]["parameters"] == {"tol": 1e-5, "max_iter": 3}
    assert type(spec.raw["slices"][0]["parameters"]["max_iter"]) is int
    assert spec.slices[0].settings == {"tol": 1e-5, "max_iter": 3}


@pytest.mark.parametrize("key,value,needle", [
    ("normalize", 0.5, "expected true or false"),
    ("normalize", 2, "expected true or false"),
    ("normalize", "yes please", "expected true or false"),
    ("lambda", "1e-5x", "expected a number"),
    ("lambda", "nan", "expected a finite number"),
    ("lambda", True, None),  # mergekit reads true as 1.0: accepted
])
def test_refused_values_name_the_key(tmp_path: Path, key: str, value: Any,
                                     needle: str | None) -> None:
    doc = {"merge_method": "task_arithmetic", "base_model": "./base",
           "models": [{"model": "./a", "parameters": {"weight": 0.5}}],
           "parameters": {key: value}}
    if needle is None:
        assert _spec(tmp_path, yaml.safe_dump(doc)).parameters[key] == 1.0
        return
    with pytest.raises(SpecError) as exc:
        _spec(tmp_path, yaml.safe_dump(doc))
    assert f"parameters.{key}: {needle}" in str(exc.value)


def test_an_int_parameter_refuses_a_fraction_and_its_interpolation(tmp_path: Path) -> None:
    max_iter = ParamDef("max_iter", "int", Scope.GLOBAL, 10, lo=1)
    assert settings.check(max_iter, 0.5)[1] == "expected an integer, got 0.5"
    assert settings.check(max_iter, "1e5")[1] == "expected an integer, got '1e5'"
    checked, problem = settings.check(max_iter, ["2", 4.0])
    assert problem is None and checked == [2, 4]
    assert settings.evaluate(max_iter, checked, "x", 0.5) == 3
    with pytest.raises(ValueError, match="interpolated value 2.5"):
        settings.evaluate(max_iter, [2, 3], "x", 0.5)  # mergekit refuses it there too
    flag = ParamDef("filter_wise", "bool", Scope.GLOBAL, False)
    checked, _ = settings.check(flag, [0, 1.0])
    assert checked == [False, True]
    assert settings.evaluate(flag, checked, "x", 0.9) is False  # discrete, as mergekit's
