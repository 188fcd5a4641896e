"""Device-side user-level LRU: an opt-in extension of vLLM's own KV cache manager.

vLLM's prefix cache evicts single blocks in free-queue order, so under
pressure it nibbles every user's history from the tail and candidate blocks
compete with histories. GR wants the opposite: keep whole user histories on
the device, evict whole least-recently-used users (never one with a running
request), and leave their KV in the pool for a later swap-in.

The extension is installed onto the scheduler's live ``KVCacheManager``
(the connector does it in ``bind_kv_cache_manager``) by wrapping four bound
methods on that one instance:

* ``allocate_slots`` -- learn which user a request belongs to (running);
* ``free`` / ``pop_blocks_for_free`` -- before vLLM frees a request, record
  the user's cached history blocks (block id + block hash) as resident;
* ``block_pool.get_new_blocks`` -- before vLLM pops free blocks, make sure
  enough free blocks that belong to no resident user are at the head of the
  free queue, evicting whole LRU users (their cached hashes, via vLLM's own
  ``evict_blocks``) when there are not.

Everything else -- hit lookup, ref counts, hashing, the free queue itself --
stays vLLM's. Internals may differ between vLLM releases, so install() checks
the version (``compat.USER_LRU_VLLM``: 0.30 to 0.33) and every attribute it
touches, and refuses clearly otherwise.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ascendstore.gr import GRInputError, GRRequest, GRStats, parse_gr_request
from ascendstore.keys import NO_TENANT

log = logging.getLogger(__name__)

#: a device-resident user: (tenant id, uid). The same uid under two tenants is two
#: users (as in the pool's keys), so evicting or deleting one never touches the other.
UserRef = tuple[str, str]


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM's KV cache manager is not one the user LRU knows."""


def gr_request_of(request: Any, default_tenant: str | None = None) -> GRRequest | None:
    """GR inputs of a vLLM Request (None for ordinary or malformed ones)."""
    sp = getattr(request, "sampling_params", None)
    try:
        return parse_gr_request(
            getattr(request, "kv_transfer_params", None),
            getattr(sp, "extra_args", None),
            request.num_prompt_tokens,
            cache_salt=getattr(request, "cache_salt", None),
            default_tenant=default_tenant,
        )
    except GRInputError:
        return None


@dataclass
class _User:
    #: cached history blocks on the device: block id -> block hash when recorded
    blocks: dict[int, Any] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)
    #: deleted while running: drop its blocks when its last request frees them
    doomed: bool = False


def check_vllm_supported(kv_cache_manager: Any) -> None:
    import vllm

    from ascendstore_vllm import compat

    version = str(getattr(vllm, "__version__", "unknown"))
    if not compat.user_lru_supported(version):
        raise UnsupportedVLLMError(
            f"the GR user-level LRU (gr.user_lru) extends vLLM's KVCacheManager internals and supports "
            f"vLLM {compat.USER_LRU_VLLM}; this is vLLM {version}. Set "
            f"gr.user_lru=false (the pool still works) or use a supported vLLM."
        )
    missing = [
        name
        for name in (
            "allocate_slots", "free", "pop_blocks_for_free", "block_pool", "coordinator", "kv_cache_config",
        )
        if not hasattr(kv_cache_manager, name)
    ]
    pool = getattr(kv_cache_manager, "block_pool", None)
    for name in ("get_new_blocks", "evict_blocks", "free_block_queue", "blocks", "get_num_free_blocks"):
        if pool is not None and not hasattr(pool, name):
            missing.append(f"block_pool.{name}")
    queue = getattr(pool, "free_block_queue", None)
    for name in ("remove", "append", "prepend_n", "fake_free_list_head", "fake_free_list_tail"):
        if queue is not None and not hasattr(queue, name):
            missing.append(f"free_block_queue.{name}")
    if missing:
        raise UnsupportedVLLMError(
            f"vLLM {version}'s KV cache manager lacks {', '.join(missing)}; the GR user-level LRU "
            f"cannot be installed (set gr.user_lru=false)."
        )
    groups = kv_cache_manager.kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedVLLMError(
            f"the GR user-level LRU supports models with one KV cache group; this model has {len(groups)} "
            f"(hybrid attention). Set gr.user_lru=false."
        )


class UserKVLRU:
    """Whole-user eviction on the device. See the module docstring."""

    def __init__(
        self,
        *,
        max_resident_users: int = 0,
        min_free_blocks: int = 0,
        stats: GRStats | None = None,
        gr_of: Callable[[Any], GRRequest | None] = gr_request_of,
    ) -> None:
        self.max_resident_users = max_resident_users
        self.min_free_blocks = min_free_blocks
        self.stats = stats or GRStats()
        self.gr_of = gr_of
        self.users: OrderedDict[UserRef, _User] = OrderedDict()  # least recently used first
        self._req: dict[str, tuple[UserRef, int]] = {}  # request id -> (user, history blocks)
        self._owners: dict[int, set[UserRef]] = {}  # block id -> resident users holding it
        self._kcm: Any = None
        self._originals: dict[str, Any] = {}

    # -- installation ---------------------------------------------------------------
    def install(self, kv_cache_manager: Any) -> UserKVLRU:
        check_vllm_supported(kv_cache_manager)
        if getattr(kv_cache_manager, "_ascendstore_user_lru", None) is not None:
            raise RuntimeError("a GR user LRU is already installed on this KV cache manager")
        self._kcm = kv_cache_manager
        self.pool = kv_cache_manager.block_pool
        self.block_size = kv_cache_manager.coordinator.single_type_managers[0].block_size
        kcm, pool = kv_cache_manager, self.pool
        self._originals = {
            "allocate_slots": kcm.allocate_slots,
            "free": kcm.free,
            "pop_blocks_for_free": kcm.pop_blocks_for_free,
            "get_new_blocks": pool.get_new_blocks,
        }
        # instance attributes shadow the class methods for this one manager only
        kcm.allocate_slots = self._allocate_slots
        kcm.free = self._free
        kcm.pop_blocks_for_free = self._pop_blocks_for_free
        pool.get_new_blocks = self._get_new_blocks
        kcm._ascendstore_user_lru = self
        return self

    def uninstall(self) -> None:
        if self._kcm is None:
            return
        for name in ("allocate_slots", "free", "pop_blocks_for_free"):
            delattr(self._kcm, name)  # the instance attribute shadowed the class method
        del self.pool.get_new_blocks
        self._kcm._ascendstore_user_lru = None
        self._kcm = None

    # -- views ----------------------------------------------------------------------
    def resident_users(self) -> list[UserRef]:
        """(tenant, uid) of users with history blocks cached on the device, least recent first."""
        return [u for u, e in self.users.items() if self._live_blocks(e)]

    def running_users(self) -> set[UserRef]:
        return {u for u, e in self.users.items() if e.running}

    def device_blocks(self, uid: str, tenant: str = NO_TENANT) -> list[int]:
        e = self.users.get((tenant, uid))
        return sorted(self._live_blocks(e)) if e else []

    def _live_blocks(self, e: _User) -> list[int]:
        return [bid for bid, h in e.blocks.items() if self.pool.blocks[bid].block_hash == h]

    # -- wrapped vLLM methods -------------------------------------------------------
    def _allocate_slots(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        rid = request.request_id
        newly = None
        if rid not in self._req:
            g = self.gr_of(request)
            if g is not None:
                user = (g.tenant, g.uid)
                e = self.users.setdefault(user, _User())
                e.running.add(rid)
                self.users.move_to_end(user)
                self._req[rid] = (user, g.history_len // self.block_size)
                newly = user
        result = self._originals["allocate_slots"](request, *args, **kwargs)
        if result is None and newly is not None and not any(self._kcm.coordinator.get_blocks(rid)):
            # not admitted: the request holds nothing yet, so it is not running
            self._forget_request(rid)
        return result

    def _record_history(self, request: Any) -> list[Any]:
        """Note the request's cached history blocks as its user's; returns the
        blocks to drop instead when the user was deleted while running."""
        rid = request.request_id
        info = self._req.get(rid)
        if info is None:
            return []
        user, n_hist = info
        e = self.users.get(user)
        if e is None:
            return []
        blocks = self._kcm.coordinator.get_blocks(rid)[0][:n_hist]
        if e.doomed:
            return [b for b in blocks if b.block_hash is not None and not b.is_null]
        for b in blocks:
            if b.block_hash is not None and not b.is_null:
                e.blocks[b.block_id] = b.block_hash
                self._owners.setdefault(b.block_id, set()).add(user)
        return []

    def _forget_request(self, rid: str) -> UserRef | None:
        info = self._req.pop(rid, None)
        if info is None:
            return None
        user = info[0]
        e = self.users.get(user)
        if e is not None:
            e.running.discard(rid)
            if not e.running and not e.blocks:
                del self.users[user]
        return user

    def _free(self, request: Any) -> None:
        doomed = self._record_history(request)
        self._originals["free"](request)
        self._after_free(request.request_id, doomed)

    def _pop_blocks_for_free(self, request: Any) -> Any:
        doomed = self._record_history(request)
        blocks = self._originals["pop_blocks_for_free"](request)
        self._after_free(request.request_id, doomed)
        return blocks

    def _after_free(self, rid: str, doomed: list[Any]) -> None:
        if doomed:  # a deleted user's last blocks: out of the prefix cache
            self.pool.evict_blocks({b.block_id for b in doomed})
        user = self._forget_request(rid)
        e = self.users.get(user) if user else None
        if e is not None and e.doomed and not e.running:
            self._evict(user, count=False)
        if self.max_resident_users:
            self._enforce_max_users()

    def _get_new_blocks(self, num_blocks: int) -> Any:
        try:
            self._make_room(num_blocks)
        except Exception:  # never let bookkeeping break vLLM's allocation
            log.exception("GR user LRU: make_room failed; falling back to vLLM's block LRU")
        return self._originals["get_new_blocks"](num_blocks)

    # -- policy ---------------------------------------------------------------------
    def _protected_free(self) -> set[int]:
        out: set[int] = set()
        blocks = self.pool.blocks
        for e in self.users.values():
            for bid, h in e.blocks.items():
                b = blocks[bid]
                if b.ref_cnt == 0 and b.block_hash == h:
                    out.add(bid)
        return out

    def _make_room(self, n: int) -> None:
        free = self.pool.get_num_free_blocks()
        tracked = sum(len(e.blocks) for e in self.users.values())
        need = n + self.min_free_blocks
        if free - tracked >= need:
            return  # even if every tracked block were free, the rest suffices
        protected = self._protected_free()
        unprotected = free - len(protected)
        if unprotected < need:
            for user in list(self.users):
                if unprotected >= need:
                    break
                if self.users[user].running:
                    continue  # never a user with a running request
                released = self._evict(user)
                if released:
                    protected -= released
                    unprotected += len(released)
        if protected:
            self._keep_protected_behind(n, protected)

    def _keep_protected_behind(self, n: int, protected: set[int]) -> None:
        """Reorder the free queue so its first ``n`` blocks belong to no resident
        user (as far as such blocks exist); resident users' blocks move to the tail."""
        q = self.pool.free_block_queue
        blk = q.fake_free_list_head.next_free_block
        tail = q.fake_free_list_tail
        seen = 0
        moved: list[Any] = []
        remaining = q.num_free_blocks
        while blk is not tail and seen < n and remaining > 0:
            nxt = blk.next_free_block
            if blk.block_id in protected:
                moved.append(blk)
            else:
                seen += 1
            blk = nxt
            remaining -= 1
        for b in moved:
            q.remove(b)
        q.append_n(moved)

    def _evict(self, user: UserRef, count: bool = True) -> set[int]:
        """Drop a user's cached history from the device prefix cache; returns the
        free blocks released (now hash-less, at the head of the free queue)."""
        e = self.users.pop(user, None)
        if e is None:
            return set()
        released: set[int] = set()
        for bid, h in e.blocks.items():
            owners = self._owners.get(bid)
            if owners is not None:
                owners.discard(user)
                if not owners:
                    del self._owners[bid]
            b = self.pool.blocks[bid]
            if b.block_hash != h or b.ref_cnt != 0:
                continue  # reused by vLLM already, or held by some running request
            if owners and any(self.users.get(o) and bid in self.users[o].blocks for o in owners):
                continue  # shared prefix still needed by another resident user
            released.add(bid)
        if released:
            self.pool.evict_blocks(released)
            q = self.pool.free_block_queue
            blocks = [self.pool.blocks[bid] for bid in released]
            for b in blocks:
                q.remove(b)
            q.prepend_n(blocks)
        if e.running:
            e.blocks.clear()
            e.doomed = True
            self.users[user] = e
        if count:
            self.stats.add(lru_evictions=1)
        log.debug("GR user LRU: evicted user %s (%d blocks)", user, len(released))
        return released

    def _enforce_max_users(self) -> None:
        resident = self.resident_users()
        excess = len(resident) - self.max_resident_users
        idle = [u for u in resident if not self.users[u].running]
        for user in idle[: max(0, excess)]:
            self._evict(user)

    def evict_user(self, uid: str, tenant: str = NO_TENANT) -> bool:
        """Drop user ``uid`` of ``tenant`` from the device now (a running user: its idle
        blocks now, the rest when its requests end). Used by delete-user; returns
        whether the user was known. The same uid of other tenants is left alone."""
        user = (tenant, uid)
        if user not in self.users:
            return False
        self._evict(user, count=False)  # a running user is doomed: dropped when it ends
        return True

    def touch(self, uid: str, tenant: str = NO_TENANT) -> None:
        if (tenant, uid) in self.users:
            self.users.move_to_end((tenant, uid))
