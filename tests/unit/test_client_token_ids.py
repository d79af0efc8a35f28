"""What counts as a token-id prompt."""

from __future__ import annotations

from typing import Any

import pytest

from kvplane.services.client.tokenize import is_token_ids


@pytest.mark.parametrize("value", [[0], [1, 2, 3], list(range(10_000))])
def test_non_negative_ints_are_token_ids(value: list[int]) -> None:
    assert is_token_ids(value)


@pytest.mark.parametrize(
    "value",
    [[], [1, -1], [1, True], [False], [1, 2.0], [1, "2"], [[1]], "1 2", (1, 2), None, [1, None]],
)
def test_anything_else_is_not(value: Any) -> None:
    assert not is_token_ids(value)
