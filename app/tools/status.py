"""`kvfence status`: the operator's view of a deployment's workers.

Where the workers are comes from etcd (`--discovery etcd://HOST:PORT`: every registration, with
its role, control address, incarnation, device and pool size); how their pools stand comes from a
front end's /metrics (`--front URL`: pages free, in use, quarantined and cached per worker, and
whether it drains). With both, each worker's health is what the two say together:

- `serving`: registered, and the front end serves through it;
- `draining`: the front end serves through it, but it shuts down (it takes no new request);
- `unpaired`: registered, but the front end does not serve through it (still joining, refused at
  pairing, or serving another front end);
- `unregistered`: the front end serves through it, but etcd no longer lists it (its lease
  expired: it is about to be closed).

With only one of the two, the columns the other would fill are empty and health says what is known.
"""

from __future__ import annotations

import dataclasses
import json

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvfence.app.remote.discovery import parse_discovery
from kvfence.app.remote.membership import ETCD_ERRORS, registered_workers
from kvfence.transports.core.secret import DeploymentSecret

STATES = ("total", "free", "in_use", "quarantined", "cached")


@dataclasses.dataclass
class WorkerStatus:
    name: str  # role@control address, as the front end names it
    role: str
    incarnation: str = ""
    device: str = ""
    pages: dict[str, int] = dataclasses.field(default_factory=dict)  # state -> pages, from the front end
    registered: bool = False
    served: bool = False
    draining: bool = False
    asked_etcd: bool = True

    @property
    def health(self) -> str:
        if not self.served:
            return "unpaired" if self.registered else "unknown"
        if self.draining:
            return "draining"
        return "serving" if self.registered or not self.asked_etcd else "unregistered"


async def collect(discovery: str | None, front: str | None, admin_key: str | None = None,
                  secret: DeploymentSecret | None = None) -> list[WorkerStatus]:
    """Every worker etcd lists (with `secret`: only those whose registration it signed) and every
    worker the front end serves through. ValueError (its message for the user) when neither can
    be asked or answers."""
    if discovery is None and front is None:
        raise ValueError("say where the workers are: --discovery etcd://HOST:PORT and/or --front URL")
    found: dict[str, WorkerStatus] = {}
    if discovery is not None:
        etcd = parse_discovery(discovery).etcd
        if etcd is None:
            raise ValueError("--discovery static://... lists no workers by itself: give --front URL instead")
        try:
            registrations = await registered_workers(*etcd, secret)
        except ETCD_ERRORS as e:
            raise ValueError(f"etcd at {etcd[0]}:{etcd[1]} does not answer: {e}") from None
        for r in registrations:
            found[f"{r.role}@{r.control}"] = WorkerStatus(name=f"{r.role}@{r.control}", role=r.role,
                                                          incarnation=r.incarnation, device=r.device,
                                                          pages={"total": r.num_pages}, registered=True)
    if front is not None:
        for name, pages, draining in await _front_pools(front, admin_key):
            status = found.setdefault(name, WorkerStatus(name=name, role=name.split("@", 1)[0],
                                                         asked_etcd=discovery is not None))
            status.pages.update(pages)
            status.served, status.draining = True, draining
    return sorted(found.values(), key=lambda s: (s.role != "prefill", s.name))


async def _front_pools(front: str, admin_key: str | None) -> list[tuple[str, dict[str, int], bool]]:
    headers = {"authorization": f"Bearer {admin_key}"} if admin_key else None
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.get(front.rstrip("/") + "/metrics", headers=headers)
    except httpx.HTTPError as e:
        raise ValueError(f"the front end at {front} does not answer: {e}") from None
    if response.status_code != 200:
        raise ValueError(f"the front end at {front} answered /metrics with {response.status_code}"
                         + (" (give its admin key: --admin-key)" if response.status_code in (401, 403) else ""))
    pools: dict[str, dict[str, int]] = {}
    draining: dict[str, bool] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            worker = sample.labels.get("worker")
            if worker is None:
                continue
            if sample.name == "kvfence_kv_pages" and sample.labels.get("state") in STATES:
                pools.setdefault(worker, {})[sample.labels["state"]] = int(sample.value)
            elif sample.name == "kvfence_worker_draining":
                draining[worker] = bool(sample.value)
    return [(name, pages, draining.get(name, False)) for name, pages in pools.items()]


def render(rows: list[WorkerStatus], as_json: bool = False) -> str:
    if as_json:
        return json.dumps([{**dataclasses.asdict(r), "health": r.health} for r in rows], indent=2)
    if not rows:
        return "no workers found"
    header = ("worker", "role", "incarnation", "device", *STATES, "health")
    table = [header] + [(r.name, r.role, r.incarnation[:12], r.device,
                         *(str(r.pages[s]) if s in r.pages else "-" for s in STATES), r.health) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)


def status(discovery: str | None, front: str | None, admin_key: str | None, as_json: bool,
           secret: DeploymentSecret | None = None) -> int:
    print(render(anyio.run(collect, discovery, front, admin_key, secret), as_json))
    return 0
