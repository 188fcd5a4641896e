"""Pool keys: stable, parseable, isolating models, layouts, tenants and ranks."""

import hashlib
import os
import random
import subprocess
import sys

import pytest

from ascendstore.contract import keys_fit
from ascendstore.keys import (
    KVFingerprint,
    PoolKey,
    RankPart,
    UserKey,
    block_hash_hex,
    chunk_hashes,
    model_key_name,
    tenant_id,
    tenant_prefix,
)

FP = dict(
    model="Qwen/Qwen3-8B", dtype="bfloat16", kv_layout="LBNHC", block_size=16, chunk_size=64,
    num_layers=36, num_kv_heads=8, head_size=128, tp_size=1,
)


def test_fingerprint_changes_with_anything_that_changes_bytes():
    base = KVFingerprint(**FP).digest()
    for field, value in [("dtype", "float16"), ("kv_layout", "NHD"), ("chunk_size", 128),
                         ("num_kv_heads", 4), ("tp_size", 2), ("model", "other"), ("use_mla", True)]:
        assert KVFingerprint(**{**FP, field: value}).digest() != base, field
    assert KVFingerprint(**FP).digest() == base


def test_fingerprint_is_deterministic_across_processes_without_hashseed():
    code = ("from ascendstore.keys import KVFingerprint;"
            f"print(KVFingerprint(**{FP!r}).digest(), end='')")
    outs = set()
    for seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, check=True).stdout)
    assert outs == {KVFingerprint(**FP).digest()}


def test_pool_key_round_trip_and_layer_form():
    for layer in (None, 0, 31):
        k = PoolKey(tenant_id("salt"), KVFingerprint(**FP).digest(), RankPart(3, 1, 0, 2), "ab" * 32, layer)
        assert PoolKey.parse(k.text()) == k
    assert "@all@" in PoolKey("-", "ab", RankPart(), "cd").text()


@pytest.mark.parametrize("bad", ["", "as1@x", "as2@-@ab@h0p0c0d0@all@cd", "as1@-@ab@h0@all@cd",
                                 "as1@-@ab@h0p0c0d0@layer@cd", "as1@-@ab@h0p0c0d0@all@XYZ"])
def test_pool_key_parse_rejects_garbage(bad):
    with pytest.raises(ValueError):
        PoolKey.parse(bad)


def test_tenants_are_isolated_and_share_a_prefix():
    a = PoolKey(tenant_id("alice"), "ab", RankPart(), "cd").text()
    b = PoolKey(tenant_id("bob"), "ab", RankPart(), "cd").text()
    assert a != b
    assert a.startswith(tenant_prefix("alice")) and not b.startswith(tenant_prefix("alice"))
    assert tenant_id(None) == tenant_id("") == "-"


def test_chunk_hash_is_the_last_block_of_each_full_chunk():
    blocks = [hashlib.sha256(bytes([i])).digest() for i in range(10)]
    hs = chunk_hashes(blocks, 4)
    assert hs == [blocks[3].hex(), blocks[7].hex()]  # the partial third chunk is dropped
    assert chunk_hashes(blocks, 1) == [b.hex() for b in blocks]


def test_block_hash_forms():
    assert block_hash_hex(b"\x01\xff") == "01ff"

    class Legacy:
        hash_value = 255

    assert block_hash_hex(Legacy()) == "ff"
    with pytest.raises(TypeError):
        block_hash_hex(1.5)


def test_user_key_forms():
    k = UserKey("u-42", "qwen.1a2b", 8, 3, "kv_cache")
    assert k.text() == "u-42@qwen.1a2b@8@3@kv_cache"
    layered = UserKey("u-42", "qwen.1a2b", 8, 3, "kv_cache", 7)
    assert layered.text() == "u-42@qwen.1a2b@8@3@kv_cache@7"
    assert UserKey.parse(layered.text()) == layered
    assert UserKey.parse("u@m@1@0@token_id").value_type == "token_id"
    assert k.text().startswith(UserKey.user_prefix("u-42"))


@pytest.mark.parametrize("uid,vt", [("a@b", "kv_cache"), ("", "kv_cache"), ("u", "weights")])
def test_user_key_rejects_bad_parts(uid, vt):
    with pytest.raises(ValueError):
        UserKey(uid, "m", 1, 0, vt)


def test_model_key_name_is_key_safe():
    n = model_key_name("/models/Qwen/Qwen3 8B@v2/")
    assert "@" not in n and " " not in n and n.startswith("Qwen3_8B_v2.")
    assert model_key_name("a/b") != model_key_name("c/b")


class _Key(str):
    """A str subclass: its characters live apart from the object (not compact)."""


def _fits(keys, max_bytes: int) -> bool:
    # the rule, key by key
    return all(isinstance(k, str) and k.isascii() and 0 < len(k) <= max_bytes for k in keys)


def test_keys_fit_answers_the_per_key_rule_for_a_batch() -> None:
    # Every key a non-empty ASCII str within the bound: what a backend may send as
    # it is. Judged in C from each str's flags; never True for a batch with a misfit.
    rng = random.Random(7)
    kinds = ["a", "k" * 16, "k" * 17, "", "\u043a\u043b\u044e\u0447", "\u00e9", "ok/\u20ac", b"bytes", None, 5,
             "y" * 4096, "y" * 4097, _Key("abc")]
    for _ in range(3000):
        keys = [rng.choice(kinds) for _ in range(rng.randrange(0, 6))]
        for max_bytes in (16, 4096):
            got = keys_fit(keys, max_bytes)
            if any(type(k) is _Key for k in keys):
                assert not got or _fits(keys, max_bytes)  # (a subclass may be sent for a closer look)
            else:
                assert got == _fits(keys, max_bytes), (keys, max_bytes)
    assert keys_fit([], 1) and keys_fit(("a", "b"), 1) and not keys_fit(("a", "bb"), 1)
    with pytest.raises(TypeError):
        keys_fit(5, 1)  # type: ignore[arg-type]
