"""The twin's virtual clock: events run in (time, insertion) order, the clock never goes back."""

from deepinfer.twin.events import EventLoop


def test_events_run_in_time_then_insertion_order() -> None:
    loop, seen = EventLoop(), []
    loop.at(2.0, lambda: seen.append(("b", loop.now)))
    loop.at(1.0, lambda: seen.append(("a", loop.now)))
    loop.at(2.0, lambda: seen.append(("c", loop.now)))
    loop.run()
    assert seen == [("a", 1.0), ("b", 2.0), ("c", 2.0)]


def test_an_event_in_the_past_runs_now_after_those_due() -> None:
    loop, seen = EventLoop(), []

    def first() -> None:
        seen.append("first")
        loop.at(0.0, lambda: seen.append(("late", loop.now)))  # asks for the past

    loop.at(5.0, first)
    loop.at(5.0, lambda: seen.append("second"))
    loop.run()
    assert seen == ["first", "second", ("late", 5.0)]


def test_cancel_until_and_stop() -> None:
    loop, seen = EventLoop(), []
    ev = loop.after(1.0, lambda: seen.append("cancelled"))
    loop.after(2.0, lambda: seen.append("two"))
    loop.after(3.0, lambda: seen.append("three"))
    ev.cancel()
    loop.run(until=2.5)
    assert seen == ["two"] and loop.now == 2.5
    loop.after(0.1, lambda: seen.append("soon"))
    loop.run(stop=lambda: len(seen) == 2)
    assert seen == ["two", "soon"] and len(loop) == 1  # "three" still waits


def test_chained_events_advance_the_clock() -> None:
    loop, times = EventLoop(), []

    def tick() -> None:
        times.append(loop.now)
        if len(times) < 4:
            loop.after(0.25, tick)

    loop.after(0.0, tick)
    loop.run()
    assert times == [0.0, 0.25, 0.5, 0.75]
