"""Binary forms of the two GR value types.

``token_id`` object: a 96-byte header then the user's history as int32 token
ids, zero-padded to a size class. The header's tenant field is 32 bytes
(NUL-padded), room for any ``tenant_id()``. The backend contract reads an object only
into regions of exactly its size, and a reader does not know the stored length
in advance, so lengths are bucketed into power-of-two classes: a reader tries
the class of its own history first (the steady state: same history, same
class) and the other classes only when the backend reports a size mismatch.

``kv_cache`` object: a 32-byte header then the KV bytes of the user's history
blocks (layer-major, then block order; one object per layer in layerwise mode).
The header repeats the token record's ``generation``: a reader that finds a
different generation read a KV object from another save (a concurrent rewrite)
and must not use it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

TOKEN_MAGIC = b"ASGRTOK2"  # v1 held a 16-byte tenant: its records now read as a miss
KV_MAGIC = b"ASGRKV01"
TENANT_BYTES = 32
# magic n_tokens kv_blocks generation written_at kv_bytes tenant (72 bytes, the rest reserved)
_TOKEN_HDR = struct.Struct(f"<8sIIQdQ{TENANT_BYTES}s")
_KV_HDR = struct.Struct("<8sQIi")  # magic generation n_blocks layer (-1: all layers)
TOKEN_HEADER_BYTES = 96
KV_HEADER_BYTES = 32
MIN_CLASS_TOKENS = 256
TOKEN_DTYPE = np.int32


class RecordError(ValueError):
    """Bytes that are not a valid GR record (torn, foreign or corrupt)."""


def capacity_class(n_tokens: int) -> int:
    """Token capacity of the size class holding ``n_tokens`` (a power of two >= 256)."""
    cap = MIN_CLASS_TOKENS
    while cap < n_tokens:
        cap <<= 1
    return cap


def token_object_bytes(capacity: int) -> int:
    return TOKEN_HEADER_BYTES + capacity * np.dtype(TOKEN_DTYPE).itemsize


def class_search_order(n_tokens: int, max_tokens: int) -> list[int]:
    """Capacities to try, nearest to ``n_tokens``'s class first."""
    top = capacity_class(max(max_tokens, n_tokens))
    classes = []
    cap = MIN_CLASS_TOKENS
    while cap <= top:
        classes.append(cap)
        cap <<= 1
    first = capacity_class(n_tokens)
    return sorted(classes, key=lambda c: (abs(c.bit_length() - first.bit_length()), c))


@dataclass(frozen=True)
class TokenRecord:
    """What one rank holds for a user: history token ids and its KV object's shape."""

    tokens: np.ndarray  # int32, exactly n_tokens long
    kv_blocks: int  # blocks in the KV object (>= n_tokens / block_size)
    generation: int
    written_at: float
    kv_bytes: int  # KV bytes of this rank (headers excluded)
    tenant: str

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def encode(self, capacity: int | None = None) -> np.ndarray:
        cap = capacity_class(self.n_tokens) if capacity is None else capacity
        if cap < self.n_tokens:
            raise ValueError(f"capacity {cap} < {self.n_tokens} tokens")
        buf = np.zeros(token_object_bytes(cap), dtype=np.uint8)
        tenant = self.tenant.encode()
        if not tenant or len(tenant) > TENANT_BYTES or b"\0" in tenant:
            raise ValueError(f"tenant id {self.tenant!r} must be 1-{TENANT_BYTES} bytes without NUL")
        _TOKEN_HDR.pack_into(
            buf, 0, TOKEN_MAGIC, self.n_tokens, self.kv_blocks, self.generation,
            self.written_at, self.kv_bytes, tenant,
        )
        buf[TOKEN_HEADER_BYTES:TOKEN_HEADER_BYTES + self.n_tokens * 4] = np.ascontiguousarray(
            self.tokens, dtype=TOKEN_DTYPE
        ).view(np.uint8)
        return buf

    @classmethod
    def decode(cls, buf: np.ndarray) -> TokenRecord:
        if buf.nbytes < TOKEN_HEADER_BYTES:
            raise RecordError("token record shorter than its header")
        magic, n, kv_blocks, gen, written, kv_bytes, tenant = _TOKEN_HDR.unpack_from(buf, 0)
        if magic != TOKEN_MAGIC:
            raise RecordError(f"bad token record magic {magic!r}")
        if TOKEN_HEADER_BYTES + 4 * n > buf.nbytes:
            raise RecordError(f"token record claims {n} tokens, holds {(buf.nbytes - TOKEN_HEADER_BYTES) // 4}")
        try:
            tenant_text = tenant.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise RecordError("token record tenant is not ASCII") from None
        if not tenant_text:
            raise RecordError("token record has no tenant")
        toks = buf[TOKEN_HEADER_BYTES:TOKEN_HEADER_BYTES + 4 * n].view(TOKEN_DTYPE).copy()
        return cls(toks, kv_blocks, gen, written, kv_bytes, tenant_text)

    def with_tokens(self, n_tokens: int, written_at: float | None = None) -> TokenRecord:
        """The same KV object described by a shorter (or re-timestamped) history."""
        return TokenRecord(
            self.tokens[:n_tokens].copy(), self.kv_blocks, self.generation,
            self.written_at if written_at is None else written_at, self.kv_bytes, self.tenant,
        )


def kv_header(generation: int, n_blocks: int, layer: int | None) -> np.ndarray:
    buf = np.zeros(KV_HEADER_BYTES, dtype=np.uint8)
    _KV_HDR.pack_into(buf, 0, KV_MAGIC, generation, n_blocks, -1 if layer is None else layer)
    return buf


def check_kv_header(buf: np.ndarray, generation: int, n_blocks: int, layer: int | None) -> bool:
    magic, gen, n, lay = _KV_HDR.unpack_from(buf, 0)
    return magic == KV_MAGIC and gen == generation and n == n_blocks and lay == (-1 if layer is None else layer)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n
