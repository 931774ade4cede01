"""The prefix cache's keys: a chain hash over a prompt's full pages, rooted in the tenant.

A page-aligned block of tokens is cached under the hash of (the hash of every block before it,
its own tokens), so a key names a whole prefix, never one block alone, and the longest run of
keys found in a pool's cache (PageLedger.lookup) is the longest cached prefix. The chain's root is
salted with the authenticated tenant's name (from the API key, never from the request body); a
`cache_salt` from the body may only partition further within that tenant. Two tenants' chains
share no key however alike their prompts, and a sealed page is also tagged with its tenant's seal
(engine/owner_check.py), so even a colliding key could not let one tenant read another's page.

The scheme is named in every pool's pairing record (`BLOCK_HASH_SCHEME`), so both ends of a
transfer key their caches alike. Plain Python: no I/O.
"""

from __future__ import annotations

import hashlib
import struct

BLOCK_HASH_SCHEME = "sha256-chain-v1"
_ROOT_LABEL = b"kvfence prefix cache " + BLOCK_HASH_SCHEME.encode()


def chain_root(tenant: str, cache_salt: str = "") -> bytes:
    """The chain's root for a tenant (and optional salt within it)."""
    h = hashlib.sha256(_ROOT_LABEL)
    for part in (tenant, cache_salt):
        data = part.encode()
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return h.digest()


def block_keys(root: bytes, tokens: list[int], page_size_tokens: int, num_blocks: int) -> list[bytes]:
    """The keys of the first `num_blocks` full pages of `tokens`: each hashes its predecessor's
    key and its own token ids."""
    if num_blocks * page_size_tokens > len(tokens):
        raise ValueError(f"{num_blocks} blocks of {page_size_tokens} tokens need more than {len(tokens)} tokens")
    keys: list[bytes] = []
    prev = root
    fmt = f"<{page_size_tokens}q"
    for b in range(num_blocks):
        block = tokens[b * page_size_tokens:(b + 1) * page_size_tokens]
        prev = hashlib.sha256(prev + struct.pack(fmt, *block)).digest()
        keys.append(prev)
    return keys


def reusable_blocks(num_tokens: int, page_size_tokens: int) -> int:
    """Full pages of a prefill of `num_tokens` that a cache hit may cover: never the page of the
    last token, which must be computed to sample the next one."""
    return (num_tokens - 1) // page_size_tokens


def sealable_blocks(num_tokens: int, page_size_tokens: int) -> int:
    """Full pages of a prefill of `num_tokens`: nothing writes them again once it is done."""
    return num_tokens // page_size_tokens
