"""check_int: one int check for every argument, with a message naming the argument, the form and the value."""

from __future__ import annotations

import pytest

from dynemb.checks import check_int, check_positive_int, is_int


@pytest.mark.parametrize(
    "value,kwargs,error,message",
    [
        ("1", {}, TypeError, "seed must be an int, got '1'"),
        (1.0, {}, TypeError, "seed must be an int, got 1.0"),
        (True, {}, TypeError, "seed must be an int, got True"),
        (None, {}, TypeError, "seed must be an int, got None"),
        (0, {"minimum": 1}, ValueError, "seed must be an int >= 1, got 0"),
        (2.0, {"minimum": 1}, ValueError, "seed must be an int >= 1, got 2.0"),
        (False, {"minimum": 0}, ValueError, "seed must be an int >= 0, got False"),
        (9, {"maximum": 8}, ValueError, "seed must be an int <= 8, got 9"),
        (9, {"minimum": 0, "maximum": 8}, ValueError, r"seed must be an int in \[0, 8\], got 9"),
        ("x", {"minimum": 1, "allow_none": True}, ValueError, "seed must be None or an int >= 1, got 'x'"),
    ],
)
def test_bad_values_name_argument_form_and_value(value, kwargs, error, message):
    with pytest.raises(error, match=f"^{message}$"):
        check_int(value, "seed", **kwargs)


def test_good_values_come_back():
    assert check_int(-5, "seed") == -5
    assert check_int(0, "n", minimum=0) == 0
    assert check_int(8, "n", minimum=0, maximum=8) == 8
    assert check_int(None, "n", minimum=1, allow_none=True) is None
    assert check_positive_int(1, "dim") == 1 and check_positive_int(0, "n", minimum=0) == 0
    with pytest.raises(ValueError, match="^dim must be an int >= 1, got 0$"):
        check_positive_int(0, "dim")
    assert is_int(3) and not is_int(True) and not is_int(3.0)
