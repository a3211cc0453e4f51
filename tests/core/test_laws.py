"""Property tests of the combinator laws.

Operations are built from a small algebra of device steps (int32 kernels that
add or multiply in place, copies, fresh arrays) and compared through the data
they produce.  Each law is checked on the blocking path (``op.sync()``) with
hypothesis, and on a fixed set of examples under ``await`` (asyncio and Trio).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import kernels as K
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuflow as gf

I32 = np.int32
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

Step = tuple[str, int]
Fn = Callable[[gf.DeviceArray], gf.DeviceOperation[gf.DeviceArray]]

values = st.lists(st.integers(-1000, 1000), min_size=1, max_size=40)
steps = st.tuples(st.sampled_from(["add", "mul", "copy", "fresh"]), st.integers(-9, 9))
step_lists = st.lists(steps, min_size=0, max_size=4)


def source(xs: list[int]) -> gf.DeviceOperation[gf.DeviceArray]:
    return gf.from_host(np.array(xs, dtype=I32))


def step_fn(step: Step) -> Fn:
    """A Kleisli arrow: DeviceArray -> operation producing a DeviceArray."""
    kind, c = step
    m = K.module()

    def fn(x: gf.DeviceArray) -> gf.DeviceOperation[gf.DeviceArray]:
        n = x.size
        if kind == "add":
            return m.add_i32(K.cfg(n), x, c, n)
        if kind == "mul":
            return m.mul_i32(K.cfg(n), x, c, n)
        if kind == "copy":
            return gf.copy(x)
        return gf.full(n, c, I32)

    return fn


def expect(xs: list[int], chain: list[Step]) -> np.ndarray:
    a = np.array(xs, dtype=np.int64)
    for kind, c in chain:
        a = {"add": a + c, "mul": a * c, "copy": a, "fresh": np.full(a.shape, c)}[kind]
    return a.astype(I32)


def host(op: gf.DeviceOperation[gf.DeviceArray]) -> np.ndarray:
    return gf.to_host(op).sync()


def then_all(op: gf.DeviceOperation[gf.DeviceArray], chain: list[Step]) -> Any:
    for s in chain:
        op = op.then(step_fn(s))
    return op


# -- the laws on the blocking path (hypothesis) ---------------------------------------------------


@SETTINGS
@given(xs=values, f=steps, g=steps, h=steps)
def test_then_is_associative(xs: list[int], f: Step, g: Step, h: Step) -> None:
    a = source(xs)
    ff, gg, hh = step_fn(f), step_fn(g), step_fn(h)
    left = a.then(ff).then(gg).then(hh)
    right = a.then(lambda x: ff(x).then(lambda y: gg(y).then(hh)))
    want = expect(xs, [f, g, h])
    np.testing.assert_array_equal(host(left), want)
    np.testing.assert_array_equal(host(right), want)


@SETTINGS
@given(xs=values, f=steps)
def test_value_is_a_unit_of_then(xs: list[int], f: Step) -> None:
    x = source(xs).sync()
    ff = step_fn(f)
    # left identity: value(x).then(f) == f(x)
    np.testing.assert_array_equal(host(gf.value(x).then(ff)), expect(xs, [f]))
    y = source(xs).sync()
    np.testing.assert_array_equal(host(ff(y)), expect(xs, [f]))
    # right identity: a.then(value) == a
    out = source(xs).then(gf.value).sync()
    assert isinstance(out, gf.DeviceArray)
    np.testing.assert_array_equal(host(gf.value(out)), np.array(xs, dtype=I32))


@SETTINGS
@given(xs=values, ks=st.lists(st.integers(-5, 5), min_size=2, max_size=4))
def test_map_composes(xs: list[int], ks: list[int]) -> None:
    fns = [lambda a, k=k: a * k + 1 for k in ks]
    chained = gf.to_host(source(xs))
    for fn in fns:
        chained = chained.map(fn)

    def composed(a: np.ndarray) -> np.ndarray:
        for fn in fns:
            a = fn(a)
        return a

    want = composed(np.array(xs, dtype=I32))
    np.testing.assert_array_equal(chained.sync(), want)
    np.testing.assert_array_equal(gf.to_host(source(xs)).map(composed).sync(), want)
    # associativity of grouping: (m.map(f)).map(g) == m.map(g . f) on device handles too
    f, g = fns[0], fns[1]
    dev = source(xs).map(lambda x: (x, x.size)).map(lambda t: t[1])
    assert dev.sync() == len(xs)
    np.testing.assert_array_equal(
        gf.to_host(source(xs)).map(f).map(g).sync(),
        gf.to_host(source(xs)).map(lambda a: g(f(a))).sync(),
    )


@SETTINGS
@given(xss=st.lists(values, min_size=1, max_size=4))
def test_zip_unzip_round_trip(xss: list[list[int]]) -> None:
    n = len(xss)
    ops = [gf.to_host(source(xs)) for xs in xss]
    # unzip(zip(ops))[i] == ops[i]
    parts = gf.zip(*ops).unzip(n)
    assert len(parts) == n
    for part, xs in zip(parts, xss, strict=True):
        np.testing.assert_array_equal(part.sync(), np.array(xs, dtype=I32))
    # zip(unzip(op)) == op
    whole = gf.zip(*[source(xs) for xs in xss])
    again = gf.zip(*whole.unzip(n)).sync()
    assert isinstance(again, tuple) and len(again) == n
    for arr, xs in zip(again, xss, strict=True):
        np.testing.assert_array_equal(host(gf.value(arr)), np.array(xs, dtype=I32))
    # first and last are the ends of the tuple
    np.testing.assert_array_equal(gf.zip(*ops).first().sync(), np.array(xss[0], dtype=I32))
    np.testing.assert_array_equal(gf.zip(*ops).last().sync(), np.array(xss[-1], dtype=I32))


@SETTINGS
@given(xs=values, chain=step_lists, runs=st.integers(1, 5))
def test_shared_runs_once(xs: list[int], chain: list[Step], runs: int) -> None:
    c = K.counter()
    op = K.bump(c).then(lambda _: then_all(source(xs), chain)).shared()
    outs = [(op if i == 0 else op.clone()).sync() for i in range(runs)]
    assert all(o is outs[0] for o in outs)
    assert K.read_count(c) == 1
    np.testing.assert_array_equal(host(gf.value(outs[0])), expect(xs, chain))
    # the unshared recipe runs each time
    plain = K.bump(c).then(lambda _: then_all(source(xs), chain))
    for _ in range(runs):
        plain.sync()
    assert K.read_count(c) == 1 + runs


@SETTINGS
@given(xs=values, chain=step_lists)
def test_then_chain_equals_its_reference(xs: list[int], chain: list[Step]) -> None:
    np.testing.assert_array_equal(host(then_all(source(xs), chain)), expect(xs, chain))


# -- the same laws under await --------------------------------------------------------------------

EXAMPLES = [
    ([1, 2, 3], ("add", 4), ("mul", -2), ("copy", 0)),
    ([0], ("fresh", 7), ("add", -1), ("mul", 3)),
    (list(range(-20, 20)), ("mul", 0), ("copy", 0), ("add", 9)),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("xs", "f", "g", "h"), EXAMPLES)
async def test_laws_under_await(xs: list[int], f: Step, g: Step, h: Step) -> None:
    ff, gg, hh = step_fn(f), step_fn(g), step_fn(h)
    a = source(xs)
    want = expect(xs, [f, g, h])
    left = await gf.to_host(a.then(ff).then(gg).then(hh))
    right = await gf.to_host(a.then(lambda x: ff(x).then(lambda y: gg(y).then(hh))))
    np.testing.assert_array_equal(left, want)
    np.testing.assert_array_equal(right, want)
    x = await source(xs)
    np.testing.assert_array_equal(await gf.to_host(gf.value(x).then(ff)), expect(xs, [f]))
    # map composition
    m1 = await gf.to_host(a).map(lambda v: v + 1).map(lambda v: v * 2)
    np.testing.assert_array_equal(m1, (np.array(xs) + 1) * 2)
    # zip / unzip round trip, run from concurrent tasks; shared source runs once
    c = await gf.zeros(1, I32)
    src = K.bump(c).then(lambda _: gf.zip(gf.to_host(a), gf.to_host(a.then(ff))))
    p0, p1 = src.unzip(2)
    got: dict[int, np.ndarray] = {}

    async def run(i: int, op: gf.DeviceOperation[Any]) -> None:
        got[i] = await op

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, 0, p0)
        tg.start_soon(run, 1, p1)
    np.testing.assert_array_equal(got[0], np.array(xs, dtype=I32))
    np.testing.assert_array_equal(got[1], expect(xs, [f]))
    assert (await gf.to_host(c))[0] == 1
