"""Request lifecycle, admission, the page ledger and batching policy. Plain Python: no torch, no I/O."""
