"""Generative-recommendation (GR) mode: a user-granular KV pool.

GR traffic is few users, many requests each: a long, stable user history is
the prefix of every request and only the candidate items after it rotate. The
pool therefore stores one object set per user (``UserKey``) instead of one per
content-hashed chunk, answers "how many leading tokens of this request does the
pool hold?" with one read, and manages lifetime per user (LRU, TTL, quotas,
delete). Nothing here imports vLLM; ``ascendstore_vllm.gr`` adapts it.
"""

from ascendstore.gr.inputs import GRInputError, GRRequest, parse_gr_request
from ascendstore.gr.stats import GRStats
from ascendstore.gr.store import UserHit, UserStore

__all__ = [
    "GRInputError",
    "GRRequest",
    "GRStats",
    "UserHit",
    "UserStore",
    "parse_gr_request",
]
