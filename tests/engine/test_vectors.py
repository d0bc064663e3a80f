"""The shared test vectors (tests/vectors.py) on every backend: the same integers everywhere."""

from __future__ import annotations

import zlib

import pytest

from tests.engines import ENGINE_PARAMS, Engine, make_engine
from tests.vectors import T0, VECTORS, Vector


@pytest.fixture(params=ENGINE_PARAMS)
def engine(request: pytest.FixtureRequest) -> Engine:
    return make_engine(request.param, request)


@pytest.mark.slow
@pytest.mark.parametrize("vector", VECTORS, ids=[v.name for v in VECTORS])
def test_vector(engine: Engine, vector: Vector) -> None:
    prefix = f"vec:{{{zlib.crc32(vector.name.encode())}}}"
    for n, call in enumerate(vector.calls):
        checks = vector.checks(call.costs, prefix)
        run = engine.refund if call.refund else engine.evaluate
        got = run(checks, now_us=T0 + call.at)
        want = tuple(
            e.decision(lim.limit) for e, lim in zip(call.expect, vector.limits, strict=True)
        )
        assert got.decisions == want, f"call {n} at +{call.at} us, costs {call.costs}"
        assert got.repaired_keys == ()
        assert got.allowed == all(e.allowed for e in call.expect)


def test_vectors_cover_every_algorithm_and_the_edges() -> None:
    algorithms = {lim.algorithm for v in VECTORS for lim in v.limits}
    assert algorithms == {
        "fixed_window", "sliding_window_log", "sliding_window_counter", "token_bucket", "gcra"
    }  # fmt: skip
    calls = [(c, v) for v in VECTORS for c in v.calls]
    assert any(0 in c.costs for c, _ in calls)  # peeks
    assert any(e.retry_us == -1 for c, _ in calls for e in c.expect)  # cost > limit
    assert any(len(v.limits) == 3 for v in VECTORS)  # multi-limit
    assert any(c.refund for c, _ in calls)
