"""Delete one GR user from a live pool with the CLI (``ascendstore pool rm --user``)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import numpy as np
from health_helpers import private_health_dir  # noqa: F401 (autouse fixture)
from test_gr_store import FakeDevice, history, make_store

from ascendstore.registry import create_backend


def test_pool_rm_user_removes_every_object_of_that_user_only():
    opts = {"name": "grcli-" + uuid.uuid4().hex[:8], "capacity": "8MiB", "page_size": "4KiB"}
    backend = create_backend("local", opts)  # holds the shared-memory pool open
    try:
        dev = FakeDevice()
        hist = history(16)
        for model, layerwise in (("m.1", False), ("m.2", True)):
            s = make_store(backend, model=model, layerwise=layerwise)
            for uid in ("u1", "u11", "u2"):
                s.save_kv(uid, hist, dev.regions(range(4)))
        before = sorted(backend.list_keys(""))
        cmd = [sys.executable, "-m", "ascendstore.cli", "pool", "rm", "--user", "u1", "--yes",
               "--backend", "local", "--backend-config", json.dumps(opts)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr + out.stdout
        after = sorted(backend.list_keys(""))
        assert [k for k in before if k.startswith("u1@")] and not [k for k in after if k.startswith("u1@")]
        assert after == [k for k in before if not k.startswith("u1@")]  # u11 and u2 untouched
        assert make_store(backend, model="m.1").lookup("u11", np.asarray(hist)).hit_tokens == 16
    finally:
        backend.close()


def test_pool_rm_user_of_a_tenant_leaves_the_same_uid_of_other_tenants():
    from typer.testing import CliRunner

    from ascendstore.cli import get_app
    from ascendstore.keys import UserKey, tenant_id

    opts = {"name": "grcli-" + uuid.uuid4().hex[:8], "capacity": "8MiB", "page_size": "4KiB"}
    backend = create_backend("local", opts)
    try:
        dev, hist = FakeDevice(), history(16)
        s = make_store(backend, model="m.1")
        for tenant in ("-", tenant_id("acme"), tenant_id("globex")):
            assert s.save_kv("u1", hist, dev.regions(range(4)), tenant=tenant).name == "OK"
        common = ["--backend", "local", "--backend-config", json.dumps(opts)]
        args = ["pool", "rm", "--user", "u1", "--tenant", "acme", "--yes", *common]
        res = CliRunner().invoke(get_app(), args)
        assert res.exit_code == 0 and "removed 2 key(s)" in res.output, res.output
        left = sorted(backend.list_keys(""))
        assert not [k for k in left if k.startswith(UserKey.user_prefix("u1", tenant_id("acme")))]
        assert len(left) == 4  # no-tenant u1 and globex's u1 untouched
        res = CliRunner().invoke(get_app(), ["pool", "rm", "--user", "u1", "--yes", *common])
        assert res.exit_code == 0 and "removed 2 key(s)" in res.output, res.output
        assert [UserKey.parse(k).tenant for k in backend.list_keys("")] == [tenant_id("globex")] * 2
    finally:
        backend.close()


def test_doctor_says_whether_gr_mode_is_on():
    """Without gr.enabled, GR requests are pooled block-wise: doctor says so; with it,
    doctor shows the user-LRU defaults of the GR design."""
    from typer.testing import CliRunner

    from ascendstore.cli import get_app

    opts = json.dumps({"name": "grdoc-" + uuid.uuid4().hex[:8], "capacity": "8MiB", "page_size": "4KiB"})
    common = ["doctor", "--backend", "local", "--backend-config", opts]
    res = CliRunner().invoke(get_app(), common)
    text = " ".join(res.output.split())
    assert res.exit_code == 0 and "GR mode is off" in text and "candidates included" in text, res.output
    res = CliRunner().invoke(get_app(), [*common, "--kv-transfer-config", '{"gr": {"enabled": true}}'])
    text = " ".join(res.output.split())
    assert res.exit_code == 0 and "ok GR mode: on" in text, res.output
    assert "user LRU on (max_resident_users=100, min_free_blocks=16)" in text
