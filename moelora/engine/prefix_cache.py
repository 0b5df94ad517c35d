"""Automatic prefix caching keyed by adapter: which full KV blocks already hold a prompt prefix's keys and values.

A full block of a sequence is named by a hash chain:

    h_0 = sha256(identity, tokens[0:B])
    h_i = sha256(h_{i-1}, identity, tokens[i*B:(i+1)*B])

where `identity` is what the keys and values were computed under: "base" for the base model, or the adapter's
content digest (sha256 of its files, taken at load) — never its name. So the same prompt under two adapters, or
under an adapter and the base model, never shares a block; an adapter reloaded under the same name with new
weights never hits the old one's blocks; the same files loaded under two names share. sha256 (not Python's hash)
so that no tenant can craft a prompt whose blocks collide with another's.

The KV cache (engine/kv_cache.py) keeps the hash -> block index, the reference counts, and the freed cached blocks
in least-recently-used order until memory is needed; the scheduler matches a request's prefix when it admits it.
"""

from __future__ import annotations

import hashlib
from array import array

BASE_IDENTITY = "base"


def adapter_identity(digest: str) -> str:
    """The identity of the keys and values an adapter computes: its content digest."""
    return f"lora:{digest}"


def chain_hash(parent: bytes | None, identity: str, tokens: list[int]) -> bytes:
    """The name of one full block: its parent's name (None for the first block), the identity and its token ids."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else b"\0" * 32)
    h.update(identity.encode())
    h.update(b"\0")
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_hashes(hashes: list[bytes], tokens_at, num_tokens: int, block_size: int, identity: str,
                  unknown: int) -> list[bytes]:
    """Extend `hashes` (the chain of the first len(hashes) full blocks) to every full block within the first
    num_tokens tokens; tokens_at(start, stop) gives the token ids. Stops at a block holding `unknown` (a token
    still on the device under asynchronous scheduling). Returns `hashes`, extended in place."""
    while (len(hashes) + 1) * block_size <= num_tokens:
        i = len(hashes)
        toks = tokens_at(i * block_size, (i + 1) * block_size)
        if unknown in toks:
            break
        hashes.append(chain_hash(hashes[-1] if hashes else None, identity, toks))
    return hashes
