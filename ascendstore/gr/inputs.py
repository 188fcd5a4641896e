"""Per-request GR inputs: which user, and how much of the prompt is their history.

Read from the request's ``kv_transfer_params`` and, as vllm-ascend GR clients
send them, from sampling ``extra_args``. A request without ``uid`` is an
ordinary request (plain prefix caching). Only the history is ever pooled; the
candidates after it rotate and are recomputed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ascendstore.keys import KEY_VERSION, tenant_id

UID_KEY = "uid"
HISTORY_KEY = "user_history_len"
CANDIDATES_KEY = "candidate_num"
KNOWN_KEYS = (UID_KEY, HISTORY_KEY, CANDIDATES_KEY)
_UID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class GRInputError(ValueError):
    """A request's GR fields cannot be used; the message names the field."""


@dataclass(frozen=True)
class GRRequest:
    uid: str
    #: leading prompt tokens that are the user's history (the pooled part).
    history_len: int
    #: key component of the request's tenant (from cache_salt or the default).
    tenant: str


def _pick(name: str, sources: list[tuple[str, Mapping[str, Any]]]) -> Any:
    found = [(where, src[name]) for where, src in sources if src.get(name) is not None]
    if not found:
        return None
    values = {str(v) for _, v in found}  # 12 and "12" are the same uid or count
    if len(values) > 1:
        detail = ", ".join(f"{where}={v!r}" for where, v in found)
        raise GRInputError(f"GR field {name!r} given twice with different values ({detail})")
    return found[0][1]


def _as_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise GRInputError(f"GR field {name!r} must be a non-negative integer, not {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise GRInputError(f"GR field {name!r} must be a non-negative integer, not {value!r}") from None
    if n < 0:
        raise GRInputError(f"GR field {name!r} must be a non-negative integer, not {value!r}")
    return n


def check_uid(uid: Any) -> str:
    """A uid usable as the first component of a user key."""
    if isinstance(uid, bool) or not isinstance(uid, str | int):
        raise GRInputError(f"GR field 'uid' must be a string or integer, not {uid!r}")
    text = str(uid)
    if not _UID.fullmatch(text):
        raise GRInputError(f"GR field 'uid' {text!r} must be 1-128 characters of [A-Za-z0-9._:-]")
    if text == KEY_VERSION:
        # chunk keys start with "as1@": a user of that name would share their key prefix.
        raise GRInputError(f"GR field 'uid' {text!r} is reserved (it prefixes the pool's chunk keys)")
    return text


def parse_gr_request(
    kv_transfer_params: Mapping[str, Any] | None,
    extra_args: Mapping[str, Any] | None,
    num_prompt_tokens: int,
    *,
    cache_salt: str | None = None,
    default_tenant: str | None = None,
) -> GRRequest | None:
    """The request's GR inputs, or None for an ordinary (non-GR) request.

    ``user_history_len`` counts history tokens directly; ``candidate_num``
    counts the candidate tokens at the end of the prompt (vllm-ascend's
    field), so history = prompt - candidates. Given both, they must agree.
    """
    sources = [
        (where, src)
        for where, src in (("kv_transfer_params", kv_transfer_params), ("extra_args", extra_args))
        if isinstance(src, Mapping)
    ]
    uid = _pick(UID_KEY, sources)
    if uid is None:
        return None
    uid = check_uid(uid)
    hist = _pick(HISTORY_KEY, sources)
    cand = _pick(CANDIDATES_KEY, sources)
    if hist is None and cand is None:
        raise GRInputError(
            f"GR request for uid {uid!r} needs {HISTORY_KEY!r} (history tokens) or "
            f"{CANDIDATES_KEY!r} (candidate tokens at the end of the prompt)"
        )
    history_len = None if hist is None else _as_count(HISTORY_KEY, hist)
    if cand is not None:
        n_cand = _as_count(CANDIDATES_KEY, cand)
        if n_cand > num_prompt_tokens:
            raise GRInputError(
                f"GR field {CANDIDATES_KEY!r}={n_cand} exceeds the prompt length {num_prompt_tokens}"
            )
        from_cand = num_prompt_tokens - n_cand
        if history_len is not None and history_len != from_cand:
            raise GRInputError(
                f"GR fields disagree: {HISTORY_KEY!r}={history_len} but {CANDIDATES_KEY!r}={n_cand} "
                f"leaves {from_cand} history tokens of a {num_prompt_tokens}-token prompt"
            )
        history_len = from_cand
    assert history_len is not None
    if history_len > num_prompt_tokens:
        raise GRInputError(
            f"GR field {HISTORY_KEY!r}={history_len} exceeds the prompt length {num_prompt_tokens}"
        )
    return GRRequest(uid=uid, history_len=history_len, tenant=tenant_id(cache_salt or default_tenant))
