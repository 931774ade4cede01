"""A worker's page table per lease: the pages a lease's tokens live in, in order.

The scheduler sends each page once (`SeqStep.new_pages`, when the lease grows) and names the
leases that ended (`RunStep.ended`); the worker appends and forgets here. A table is only a list
of page numbers: every read through it is still checked against the pages' owner tags (and the
KV sanitizer), so a stale or wrong table is refused, never trusted. Beside each table, the
lease's tenant as its grant named it, for the worker's log lines (`who`).
"""

from __future__ import annotations

from kvfence.engine.ids import id_hex


class LeasePageTables:
    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}
        self._tenants: dict[int, str] = {}

    def __len__(self) -> int:
        """The leases the worker knows anything of (a table or a tenant)."""
        return len(self._tables.keys() | self._tenants.keys())

    def name(self, lease: int, tenant: str) -> None:
        if tenant:
            self._tenants[lease] = tenant

    def who(self, lease: int) -> str:
        """How the worker's log lines name a lease: its id and, when a grant named it, its tenant."""
        tenant = self._tenants.get(lease)
        return f"lease {id_hex(lease)}" + (f" (tenant {tenant})" if tenant else "")

    def extend(self, lease: int, pages: list[int]) -> list[int]:
        """Append `pages` to `lease`'s table (a first step creates it); returns the whole table."""
        table = self._tables.setdefault(lease, [])
        table.extend(pages)
        return table

    def forget(self, leases: list[int]) -> None:
        for lease in leases:
            self._tables.pop(lease, None)
            self._tenants.pop(lease, None)

    def clear(self) -> None:
        self._tables.clear()
        self._tenants.clear()
