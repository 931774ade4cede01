"""`kvfence status` (app/tools/status.py): what etcd and a front end say about each worker, joined into
one health word, and errors a user can act on when neither can be asked."""

from __future__ import annotations

import anyio
import pytest

from kvfence.app.tools.status import WorkerStatus, collect, render


def test_health_joins_what_etcd_and_the_front_end_say() -> None:
    assert WorkerStatus(name="d@h:1", role="decode", registered=True, served=True).health == "serving"
    assert WorkerStatus(name="d@h:1", role="decode", registered=True, served=True, draining=True).health == "draining"
    assert WorkerStatus(name="d@h:1", role="decode", registered=True).health == "unpaired"
    assert WorkerStatus(name="d@h:1", role="decode", served=True).health == "unregistered"  # its lease expired
    # etcd not asked
    assert WorkerStatus(name="d@h:1", role="decode", served=True, asked_etcd=False).health == "serving"


def test_the_table_has_a_row_per_worker_and_every_page_state() -> None:
    rows = [WorkerStatus(name="prefill@10.0.0.2:9301", role="prefill", incarnation="ab" * 16, device="cpu",
                         pages={"total": 256, "free": 250, "in_use": 6, "quarantined": 0, "cached": 0},
                         registered=True, served=True),
            WorkerStatus(name="decode@10.0.0.3:9301", role="decode", incarnation="cd" * 16, device="cuda:0",
                         pages={"total": 512}, registered=True)]
    lines = render(rows).splitlines()
    assert lines[0].split() == ["worker", "role", "incarnation", "device", "total", "free", "in_use",
                                "quarantined", "cached", "health"]
    assert lines[1].split() == ["prefill@10.0.0.2:9301", "prefill", "abababababab", "cpu", "256", "250", "6", "0",
                                "0", "serving"]
    assert lines[2].split()[-1] == "unpaired" and lines[2].split()[5:9] == ["-"] * 4


def test_it_says_what_to_give_when_it_cannot_ask_anyone() -> None:
    with pytest.raises(ValueError, match="--discovery etcd://HOST:PORT and/or --front URL"):
        anyio.run(collect, None, None)
    with pytest.raises(ValueError, match="give --front URL"):
        anyio.run(collect, "static://127.0.0.1:1", None)
    with pytest.raises(ValueError, match="does not answer"):
        anyio.run(collect, None, "http://127.0.0.1:9")
