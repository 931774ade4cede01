"""A worker's page table per lease: the pages a lease's tokens live in, in order.

The scheduler sends each page once (`SeqStep.new_pages`, when the lease grows) and names the
leases that ended (`RunStep.ended`); the worker appends and forgets here. A table is only a list
of page numbers: every read through it is still checked against the pages' owner tags (and the
KV sanitizer), so a stale or wrong table is refused, never trusted.
"""

from __future__ import annotations


class LeasePageTables:
    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._tables)

    def extend(self, lease: int, pages: list[int]) -> list[int]:
        """Append `pages` to `lease`'s table (a first step creates it); returns the whole table."""
        table = self._tables.setdefault(lease, [])
        table.extend(pages)
        return table

    def forget(self, leases: list[int]) -> None:
        for lease in leases:
            self._tables.pop(lease, None)

    def clear(self) -> None:
        self._tables.clear()
