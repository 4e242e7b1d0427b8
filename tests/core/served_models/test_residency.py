from __future__ import annotations

import math

import pytest

from courier.core.served_models.residency import (
    FOREVER,
    Residency,
    Resident,
    Room,
    expired,
    fits_now,
    parse_keep_alive,
    plan_room,
)

LOADED, LOADING, UNLOADING, NOT_LOADED = (
    Residency.LOADED,
    Residency.LOADING,
    Residency.UNLOADING,
    Residency.NOT_LOADED,
)


def resident(
    name: str,
    charge: int,
    *,
    residency: Residency = LOADED,
    in_flight: int = 0,
    last_used: float = 0.0,
    pinned: bool = False,
    idle_until: float = FOREVER,
) -> Resident:
    return Resident(
        name=name,
        residency=residency,
        charge=charge,
        in_flight=in_flight,
        last_used=last_used,
        pinned=pinned,
        idle_until=idle_until,
    )


@pytest.mark.parametrize(
    ("residents", "need", "budget", "max_loaded", "expected"),
    [
        ([], 10, 100, 0, Room()),
        ([resident("a", 50)], 50, 100, 0, Room()),
        # the least recently used idle model goes first
        ([resident("a", 50, last_used=2), resident("b", 50, last_used=1)], 50, 100, 0, Room(evict=("b",))),
        ([resident("a", 50, last_used=2), resident("b", 50, last_used=1)], 60, 100, 0, Room(evict=("b", "a"))),
        # idle before busy, whatever their age
        (
            [resident("old", 50, last_used=1, in_flight=1), resident("new", 50, last_used=5)],
            50,
            100,
            0,
            Room(evict=("new",)),
        ),
        # busy ones are drained only when idle ones are not enough
        (
            [resident("busy", 50, last_used=1, in_flight=2), resident("idle", 40, last_used=5)],
            90,
            100,
            0,
            Room(evict=("idle",), drain=("busy",)),
        ),
        # pinned and loading models never go
        ([resident("p", 50, pinned=True), resident("b", 30, last_used=9)], 50, 100, 0, Room(evict=("b",))),
        ([resident("l", 50, residency=LOADING), resident("b", 30)], 50, 100, 0, Room(evict=("b",))),
        # only a model still loading stands in the way: wait for it
        ([resident("l", 60, residency=LOADING)], 50, 100, 0, Room(wait=True)),
        ([resident("l", 1, residency=LOADING)], 1, 100, 1, Room(wait=True)),
        # an unloading model's memory is on its way back: nothing more to evict
        ([resident("u", 80, residency=UNLOADING), resident("b", 20)], 80, 100, 0, Room()),
        # a model not loaded holds nothing
        ([resident("n", 80, residency=NOT_LOADED)], 100, 100, 0, Room()),
        # by count: one must go although memory is plenty
        ([resident("a", 1, last_used=1), resident("b", 1, last_used=2)], 1, 100, 2, Room(evict=("a",))),
        ([resident("a", 1, last_used=1), resident("b", 1, last_used=2)], 1, 100, 1, Room(evict=("a", "b"))),
    ],
)
def test_plan_room(residents: list[Resident], need: int, budget: int, max_loaded: int, expected: Room) -> None:
    assert plan_room(residents, need=need, budget=budget, max_loaded=max_loaded) == expected


@pytest.mark.parametrize(
    ("residents", "need", "budget", "max_loaded", "reason"),
    [
        ([], 101, 100, 0, "more than the whole budget"),
        ([resident("p", 60, pinned=True)], 50, 100, 0, "p (loaded, pinned)"),
        ([resident("l", 60, residency=LOADING, pinned=True)], 50, 100, 0, "l (loading, pinned)"),
        ([resident("p", 1, pinned=True)], 1, 100, 1, "--max-loaded-models 1"),
    ],
)
def test_plan_room_refuses_what_cannot_fit(
    residents: list[Resident], need: int, budget: int, max_loaded: int, reason: str
) -> None:
    room = plan_room(residents, need=need, budget=budget, max_loaded=max_loaded)
    assert not room.fits
    assert room.refused is not None and reason in room.refused


@pytest.mark.parametrize(
    ("residents", "need", "budget", "max_loaded", "fits"),
    [
        ([], 100, 100, 0, True),
        ([resident("a", 50)], 51, 100, 0, False),
        ([resident("u", 50, residency=UNLOADING)], 51, 100, 0, False),  # still held until it is gone
        ([resident("u", 50, residency=UNLOADING)], 50, 100, 1, True),  # but it no longer counts as loaded
        ([resident("a", 1)], 1, 100, 1, False),
        ([resident("n", 99, residency=NOT_LOADED)], 100, 100, 1, True),
    ],
)
def test_fits_now(residents: list[Resident], need: int, budget: int, max_loaded: int, fits: bool) -> None:
    assert fits_now(residents, need=need, budget=budget, max_loaded=max_loaded) is fits


def test_expired_takes_idle_unpinned_loaded_models_past_their_keep_alive() -> None:
    residents = [
        resident("due-late", 1, idle_until=5),
        resident("due-early", 1, idle_until=3),
        resident("not-yet", 1, idle_until=11),
        resident("forever", 1),
        resident("busy", 1, idle_until=1, in_flight=1),
        resident("pinned", 1, idle_until=1, pinned=True),
        resident("loading", 1, idle_until=1, residency=LOADING),
        resident("unloading", 1, idle_until=1, residency=UNLOADING),
    ]
    assert expired(residents, now=10) == ("due-early", "due-late")


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (30, 30.0),
        (2.5, 2.5),
        (0, 0.0),
        (-1, FOREVER),
        ("300", 300.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("90s", 90.0),
        ("500ms", 0.5),
        ("-1", FOREVER),
        ("-5m", FOREVER),
        ("0", 0.0),
    ],
)
def test_parse_keep_alive(value: object, seconds: float) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", [True, None, "", "5 minutes", "m", "5x", [], {}, math.nan, "1h 30m"])
def test_parse_keep_alive_refuses(value: object) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)
