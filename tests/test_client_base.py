"""The sync and async clients share one base (docs STYLE 17): configuration, security and
metadata, encoding, reply decoding and error mapping live in ``_BaseClient`` and
``_BaseStream``; the subclasses differ only in I/O, so they offer the same methods."""

from __future__ import annotations

import inspect

from scheduler_service import client as c


def _public(cls: type) -> dict[str, inspect.Signature]:
    return {n: inspect.signature(f) for n, f in inspect.getmembers(cls, inspect.isfunction)
            if not n.startswith("_")}


def test_clients_and_streams_stand_on_the_shared_bases() -> None:
    assert issubclass(c.SchedulerClient, c._BaseClient) and issubclass(c.AsyncSchedulerClient, c._BaseClient)
    assert issubclass(c.ScheduleStream, c._BaseStream) and issubclass(c.AsyncScheduleStream, c._BaseStream)


def test_sync_and_async_twins_offer_the_same_methods() -> None:
    sync, aio = _public(c.SchedulerClient), _public(c.AsyncSchedulerClient)
    assert sync.keys() == aio.keys()
    for name in sync:  # the same parameters, but for the async report's async iterables
        assert list(sync[name].parameters) == list(aio[name].parameters), name
    assert _public(c.ScheduleStream).keys() == _public(c.AsyncScheduleStream).keys()


def test_the_error_mapping_is_shared() -> None:
    late = c._BaseStream._late(0.05)
    assert late.code.name == "DEADLINE_EXCEEDED" and "0.05 s" in late.message
    assert c._BaseStream._server_closed().code.name == "UNAVAILABLE"
