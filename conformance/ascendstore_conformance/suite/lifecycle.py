"""remove, remove-by-prefix, listing, close and reopen, persistence."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from ascendstore.contract import Health, Status
from ascendstore_conformance.harness import UNTOUCHED, Harness, assert_same, guarded, pattern
from ascendstore_conformance.suite.base import OpenClient, require

OK, NOT_FOUND, UNAVAILABLE, INVALID = Status.OK, Status.NOT_FOUND, Status.UNAVAILABLE, Status.INVALID
#: characters that mean something to a pattern language (regex, SQL LIKE, glob)
#: a store's native prefix call may use; tried where key_extra_chars allows them.
PATTERN_CHARS = ".+=_%*?["


def prefix_problems(h: Harness, group: str, inside: list[str], outside: list[str]) -> list[str]:
    """Put ``inside`` and ``outside`` (key names), list and remove by the
    prefix ``h.key(group)``: what went wrong, as readable lines."""
    prefix = h.key(group)
    ins, outs = h.keys(*inside), h.keys(*outside)
    assert all(k.startswith(prefix) for k in ins) and not any(k.startswith(prefix) for k in outs)
    items = {k: pattern(k, 64) for k in ins + outs}
    h.put_ok(items)
    problems = []
    if h.caps.listing:
        listed = sorted(guarded("list_keys()", h.timeout_s, lambda: list(h.backend.list_keys(prefix, 1000))))
        if listed != sorted(ins):
            problems.append(f"list_keys({prefix!r}) returned {listed}, expected {sorted(ins)}")
    result = h.call("remove_prefix", prefix, h.timeout_s)
    if result != (OK, len(ins)):
        problems.append(f"remove_prefix({prefix!r}) returned {result!r}, expected (OK, {len(ins)})")
    survived = [k for k, s in zip(ins, h.exists(ins), strict=True) if s is not NOT_FOUND]
    if survived:
        problems.append(f"remove_prefix({prefix!r}) left keys that start with it: {survived}")
    wrongly = [k for k, s in zip(outs, h.exists(outs), strict=True) if s is not OK]
    if wrongly:
        problems.append(
            f"remove_prefix({prefix!r}) removed keys that do not start with it: {wrongly} (the prefix is "
            "plain text matched at the start of the key, case-sensitive, never a pattern)"
        )
    return problems


class RemoveTests:
    def test_removed_key_is_gone(self, harness: Harness) -> None:
        gone, kept = harness.key("gone"), harness.key("kept")
        items = {gone: pattern("gone", 3000), kept: pattern("kept", 3000)}
        harness.put_ok(items)
        harness.assert_reads(items)  # warm any read path before removing
        assert harness.remove([gone]) == [OK]
        assert harness.exists([gone, kept]) == [NOT_FOUND, OK]
        statuses, (buf,) = harness.get([gone], [3000])
        assert statuses == [NOT_FOUND], f"get of a removed key returned {statuses!r}"
        assert buf.read() == bytes([UNTOUCHED]) * 3000, "get of a removed key wrote into the region"
        assert harness.remove([gone]) == [NOT_FOUND], "a second remove must report NOT_FOUND"
        harness.assert_reads({kept: items[kept]})
        # The key can be used again, with a new value.
        fresh = pattern("gone-again", 3000)
        harness.put_ok({gone: fresh})
        harness.assert_reads({gone: fresh})

    def test_batch_remove_mixing_present_and_absent(self, harness: Harness) -> None:
        a, b, absent = harness.keys("rm-a", "rm-b", "rm-absent")
        harness.put_ok({a: b"a" * 10, b: b"b" * 10})
        assert harness.remove([a, absent, b]) == [OK, NOT_FOUND, OK]
        assert harness.exists([a, b]) == [NOT_FOUND, NOT_FOUND]

    def test_remove_by_prefix(self, harness: Harness) -> None:
        require(harness, "remove_by_prefix")
        # A prefix with a regex metacharacter in it, when the key charset allows one:
        # the prefix is plain text, never a pattern.
        dot = next((c for c in ".+=" if c in harness.caps.key_extra_chars), "")
        group = f"grp{dot}"
        inside = harness.keys(f"{group}a1", f"{group}a2", f"{group}b")
        outside = harness.keys("gr", "grpXa" if dot else "grq", "other")
        items = {k: pattern(k, 100) for k in inside + outside}
        harness.put_ok(items)
        result = harness.call("remove_prefix", harness.key(group), harness.timeout_s)
        assert result == (OK, 3), f"remove_prefix of 3 matching keys returned {result!r}, expected (OK, 3)"
        assert harness.exists(inside) == [NOT_FOUND] * 3, "keys under the prefix survived remove_prefix"
        assert harness.exists(outside) == [OK] * 3, "remove_prefix removed keys outside the prefix"
        harness.assert_reads({k: items[k] for k in outside})
        again = harness.call("remove_prefix", harness.key(group), harness.timeout_s)
        assert again == (OK, 0), f"remove_prefix with nothing left returned {again!r}"

    def test_remove_prefix_matches_only_at_the_start(self, harness: Harness) -> None:
        require(harness, "remove_by_prefix")
        h = harness
        # Keys that hold the whole prefix in the middle, or at their end.
        outside = [f"mid{h.prefix}grp-a", f"mid{h.prefix}grp", "xgrp-a", "gr"]
        problems = prefix_problems(h, "grp", ["grp-a", "grp-b", "grp"], outside)
        assert not problems, "; ".join(problems)

    def test_remove_prefix_is_plain_text(self, harness: Harness) -> None:
        require(harness, "remove_by_prefix")
        h = harness
        allowed = h.caps.key_extra_chars
        chars = [c for c in PATTERN_CHARS if c in allowed]
        problems = []
        for i, c in enumerate(chars):
            # "p3g_" must not take "p3gX" (LIKE), "p3g*" not "p3g" (glob, regex), ...
            closing = "X]" if c == "[" and "]" in allowed else ""
            group = f"p{i}g{c}{closing}"
            problems += prefix_problems(h, group, [f"{group}a", f"{group}{c}"], [f"p{i}gX", f"p{i}g", f"p{i}gXa"])
        assert not problems, f"pattern characters tried: {''.join(chars)!r}; " + "; ".join(problems)

    def test_remove_prefix_is_case_sensitive(self, harness: Harness) -> None:
        require(harness, "remove_by_prefix")
        problems = prefix_problems(harness, "caseA", ["caseAa", "caseAB"], ["casea", "caseaa", "CASEAa", "CaseAa"])
        assert not problems, "keys differing from the prefix only in case: " + "; ".join(problems)

    def test_remove_prefix_of_empty_string_is_invalid(self, harness: Harness) -> None:
        require(harness, "remove_by_prefix")
        h = harness
        keys = h.keys("keep-a", "keep-b")
        h.put_ok({k: b"kept" for k in keys})
        result = h.call("remove_prefix", "", h.timeout_s)
        assert result == (INVALID, 0), (
            f"remove_prefix('') returned {result!r}; an empty prefix is INVALID and removes nothing "
            "(it would empty a store shared by every tenant)"
        )
        assert h.exists(keys) == [OK, OK], "remove_prefix('') removed keys"

    def test_listing(self, harness: Harness) -> None:
        require(harness, "listing")
        keys = harness.keys("ls-1", "ls-2", "ls-3")
        harness.put_ok({k: b"x" for k in keys} | {harness.key("other"): b"y"})
        listed = sorted(itertools.islice(harness.backend.list_keys(harness.key("ls-")), 100))
        assert listed == sorted(keys), f"list_keys(prefix) returned {listed}"
        assert len(list(harness.backend.list_keys(harness.prefix, limit=2))) == 2, "list_keys ignored limit"


class CloseReopenTests:
    def test_calls_after_close_are_unavailable(self, harness: Harness) -> None:
        key = harness.key("closed")
        harness.put_ok({key: b"before close"})
        src, dst = harness.source(b"after close!"), harness.buffer(12)
        harness.call("close")
        harness.call("close")  # closing twice is harmless
        assert harness.exists([key]) == [UNAVAILABLE]
        assert harness.statuses("put", [key], [[src.region]]) == [UNAVAILABLE]
        assert harness.statuses("get", [key], [[dst.region]]) == [UNAVAILABLE]
        assert harness.remove([key]) == [UNAVAILABLE]
        health = harness.call("health", harness.timeout_s)
        assert isinstance(health, Health) and health.status is UNAVAILABLE, (
            f"health() after close: {health!r}"
        )
        if harness.caps.remove_by_prefix:
            result = harness.call("remove_prefix", harness.prefix, harness.timeout_s)
            assert result[0] is UNAVAILABLE, f"remove_prefix() after close returned {result!r}"
        stats = harness.call("stats")
        assert isinstance(stats, Mapping), f"stats() after close returned {stats!r}, not a mapping"
        if harness.caps.listing:
            listed = guarded(
                "list_keys() after close", harness.timeout_s, lambda: list(harness.backend.list_keys(harness.prefix))
            )
            assert listed == [], f"list_keys() after close returned {listed} (a closed client lists nothing)"

    def test_reopen_after_close(self, open_client: OpenClient) -> None:
        first = open_client()
        before = first.key("before")
        data = pattern("before", 4096)
        first.put_ok({before: data})
        first.close()
        second = open_client()
        second.prefix = first.prefix
        # Not promised to survive (see the persistence test), but never stale or torn.
        status, got = second.get_bytes(before, 4096)
        assert status in (OK, NOT_FOUND), f"get after reopen returned {status!r}"
        if status is OK:
            assert_same(got or b"", data, before)
        after = pattern("after", 4096)
        second.put_ok({second.key("after"): after})
        second.assert_reads({second.key("after"): after})

    def test_a_tool_opening_the_existing_store_sees_it(self, harness: Harness, open_client: OpenClient) -> None:
        """``BackendContext.existing_only`` (``ascendstore pool``): with the store open, a
        client opened so reads what the others wrote, and its own removal is seen by them."""
        require(harness, "shared_across_processes")
        items = {harness.key(f"t{i}"): pattern(f"t{i}", 3000 + i) for i in range(3)}
        harness.put_ok(items)
        tool = open_client(existing_only=True)
        tool.prefix = harness.prefix
        tool.assert_reads(items)
        keys = list(items)
        assert tool.remove(keys[:1]) == [OK], "a client opened existing_only could not remove a key"
        assert harness.exists(keys) == [NOT_FOUND, OK, OK], "a removal by that client was not seen"

    def test_persistence_across_reopen(self, open_client: OpenClient) -> None:
        first = open_client()
        require(first, "persistent")
        items = {first.key(f"p{i}"): pattern(f"p{i}", 10000 + i) for i in range(3)}
        first.put_ok(items)
        first.remove([first.key("p2")])
        first.close()
        second = open_client()
        keys = list(items)
        assert second.exists(keys) == [OK, OK, NOT_FOUND], "persistent store lost or resurrected objects"
        second.assert_reads({k: items[k] for k in keys[:2]})
