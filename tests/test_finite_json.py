"""server/finite_json.py directly: no JSON text the server writes holds NaN or infinity; the error
names where the value is (independent of any engine: tests/test_server_slots.py covers the route)."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("starlette")

from edgeinfer_server.errors import APIError  # noqa: E402
from edgeinfer_server.finite_json import JSONResponse, dumps, non_finite_path  # noqa: E402


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_value_that_is_not_finite_is_a_500_naming_its_path(bad):
    value = {"choices": [{"index": 0, "logprobs": {"content": [{"logprob": -0.5}, {"logprob": bad}]}}]}
    assert non_finite_path(value) == "choices[0].logprobs.content[1].logprob"
    with pytest.raises(APIError) as e:
        dumps(value)
    assert e.value.status == 500 and "choices[0].logprobs.content[1].logprob" in e.value.message
    with pytest.raises(APIError):
        JSONResponse(value)


def test_finite_values_are_written_as_json_does():
    value = {"a": [1, 2.5, -0.0, 1e308], "b": {"c": None, "d": "NaN"}, "e": (True, 3)}
    assert non_finite_path(value) is None
    assert dumps(value) == json.dumps(value)
    assert json.loads(JSONResponse(value).body) == json.loads(json.dumps(value))
    assert non_finite_path(float("nan")) == "the value"
