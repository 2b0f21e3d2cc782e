"""Errors cross process boundaries intact: as (code, message, retriable), and pickled."""

from __future__ import annotations

import pickle

import pytest

from shmprod import errors as E


@pytest.mark.parametrize("retriable", [None, True, False])
def test_kafka_error_pickles_with_code_message_and_retriable(retriable: bool | None) -> None:
    err = E.KafkaError(10, "too big", retriable=retriable)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is E.KafkaError
    assert (back.code, back.name, back.message, back.retriable, str(back)) == (
        err.code,
        err.name,
        err.message,
        err.retriable,
        str(err),
    )


@pytest.mark.parametrize("code", sorted(E._BY_CODE))
def test_every_producer_error_survives_a_round_trip(code: int) -> None:
    err = E.error_from_code(code, "why", True)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == "why"
    assert (back.code, back.retriable) == (code, True)  # type: ignore[attr-defined]


def test_a_missing_extra_names_it() -> None:
    from shmprod.extras import MissingExtraError, require

    with pytest.raises(MissingExtraError, match=r"pip install 'shmprod\[spark\]'") as info:
        require("shmprod_no_such_module", "spark")
    assert isinstance(info.value, ImportError)
    assert require("json", "none").dumps([1]) == "[1]"
