"""etcd with TLS (client certificates) and username/password auth, against a real etcd.

The test makes its own CA, a server certificate for 127.0.0.1 and client
certificates (``cryptography``), starts etcd on loopback with
``--client-cert-auth``, creates a ``root`` user and enables auth through the
Store's own auth calls (the etcd v3 Auth API), then checks what a client with
and without the right credentials gets.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from controller.store import Compare, EtcdError, EtcdUnavailable, Get, Put, Store
from resilient_rl.local import ManagedProcess, etcd_binary, free_ports, port_open

PASSWORD = "s3cret-Pa55word-xyzzy"


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    b = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        b = b.add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
    else:
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if server:
        b = b.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
    return b.sign(issuer_key, hashes.SHA256())


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA etcd does not trust
    rogue_cert: Path  # a client certificate signed by other_ca
    rogue_key: Path


def make_pki(d: Path) -> Pki:
    d.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca = _cert("rrl-test-ca", ca_key, None, ca_key, ca=True)
    other_key = _key()
    other = _cert("someone-else-ca", other_key, None, other_key, ca=True)
    srv_key, cli_key, rogue_key = _key(), _key(), _key()
    srv = _cert("etcd-server", srv_key, ca, ca_key, server=True)
    # CN is not an etcd user: the certificate alone grants nothing once auth is on
    cli = _cert("rrl-client", cli_key, ca, ca_key)
    rogue = _cert("rrl-client", rogue_key, other, other_key)
    paths = {}
    for name, obj in [("ca", ca), ("other-ca", other), ("server", srv), ("client", cli), ("rogue", rogue)]:
        p = d / f"{name}.pem"
        p.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
        paths[name] = p
    for name, k in [("server", srv_key), ("client", cli_key), ("rogue", rogue_key)]:
        _write_key(k, d / f"{name}-key.pem")
    return Pki(
        ca=paths["ca"],
        server_cert=paths["server"],
        server_key=d / "server-key.pem",
        client_cert=paths["client"],
        client_key=d / "client-key.pem",
        other_ca=paths["other-ca"],
        rogue_cert=paths["rogue"],
        rogue_key=d / "rogue-key.pem",
    )


class TlsEtcd:
    """One etcd member on loopback serving clients over TLS only, client certificates required."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pki = make_pki(root / "pki")
        self.port, self.peer_port = free_ports(2)
        client, peer = f"https://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        p = self.pki
        argv = [
            etcd_binary(),
            "--name", "tls",
            "--data-dir", str(root / "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"tls={peer}",
            "--initial-cluster-state", "new",
            "--cert-file", str(p.server_cert),
            "--key-file", str(p.server_key),
            "--trusted-ca-file", str(p.ca),
            "--client-cert-auth",
        ]  # fmt: skip
        self.log = root / "etcd.log"
        self.proc = ManagedProcess.spawn("etcd:tls", argv, self.log)
        self.stores: list[Store] = []
        deadline = time.monotonic() + 20
        while not port_open("127.0.0.1", self.port):
            assert self.proc.alive(), self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "TLS etcd did not open its port"
            time.sleep(0.05)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def store(self, **kw: object) -> Store:
        kw.setdefault("timeout", 2.0)
        kw.setdefault("retry_window", 1.0)
        s = Store(self.endpoint, **kw)  # type: ignore[arg-type]
        self.stores.append(s)
        return s

    def tls_store(self, **kw: object) -> Store:
        p = self.pki
        return self.store(ca_cert=str(p.ca), cert=str(p.client_cert), key=str(p.client_key), **kw)

    def close(self) -> None:
        for s in self.stores:
            s.close()
        self.proc.stop()


@pytest.fixture
def tls_etcd(tmp_path: Path) -> Iterator[TlsEtcd]:
    server = TlsEtcd(tmp_path)
    try:
        yield server
    finally:
        server.close()


def enable_auth(server: TlsEtcd) -> None:
    """Create ``root`` (role root) with PASSWORD and turn auth on, over the TLS connection."""
    admin = server.tls_store()
    admin.user_add("root", PASSWORD)
    admin.user_grant_role("root", "root")
    admin.auth_enable()


def _fenced_txn(s: Store) -> None:
    """A txn guarded by a compare, as the leader's fenced writes are."""
    s.put("/rrl/v1/leader", "ctl-a")
    kv = s.get("/rrl/v1/leader")
    assert kv is not None
    fence = kv.create_revision
    r = s.txn([Compare("/rrl/v1/leader", "create", "=", fence)], [Put("/rrl/v1/jobs/j/state", "RUNNING")], [Get("x")])
    assert r.succeeded
    stale = s.txn([Compare("/rrl/v1/leader", "create", "=", fence + 1000)], [Put("/rrl/v1/jobs/j/state", "BAD")])
    assert not stale.succeeded
    got = s.get("/rrl/v1/jobs/j/state")
    assert got is not None and got.value == b"RUNNING"


def test_tls_client_with_certificate_works(tls_etcd: TlsEtcd) -> None:
    s = tls_etcd.tls_store()
    s.put("/k", "v")
    kv = s.get("/k")
    assert kv is not None and kv.value == b"v"
    _fenced_txn(s)
    # "https://" endpoints are accepted (and mean TLS)
    s2 = tls_etcd.store(ca_cert=str(tls_etcd.pki.ca), cert=str(tls_etcd.pki.client_cert),
                        key=str(tls_etcd.pki.client_key))  # fmt: skip
    assert s2.get("/k") is not None


def _refused(s: Store) -> str:
    with pytest.raises(EtcdError) as ei:
        s.get("/k")
    return str(ei.value)


def test_client_without_certificate_is_refused_clearly(tls_etcd: TlsEtcd) -> None:
    ep, p = tls_etcd.endpoint, tls_etcd.pki
    # TLS, trusts the server, but presents no client certificate
    msg = _refused(tls_etcd.store(ca_cert=str(p.ca)))
    assert ep in msg and "TLS" in msg and "certificate" in msg, msg
    # a client certificate from a CA the server does not trust
    msg = _refused(tls_etcd.store(ca_cert=str(p.ca), cert=str(p.rogue_cert), key=str(p.rogue_key)))
    assert ep in msg and "TLS" in msg and "certificate" in msg, msg
    # the server's certificate is not signed by the CA the client trusts
    msg = _refused(tls_etcd.store(ca_cert=str(p.other_ca), cert=str(p.client_cert), key=str(p.client_key)))
    assert ep in msg and "TLS" in msg and "certificate" in msg, msg
    # no TLS at all against a TLS-only server
    msg = _refused(tls_etcd.store())
    assert ep in msg and "TLS" in msg, msg


def test_bad_credential_files_are_named(tmp_path: Path, tls_etcd: TlsEtcd) -> None:
    p = tls_etcd.pki
    with pytest.raises(ValueError, match="RRL_ETCD_CA|ca_cert") as ei:
        Store(tls_etcd.endpoint, ca_cert=str(tmp_path / "missing.pem"))
    assert "missing.pem" in str(ei.value)
    with pytest.raises(ValueError, match="cert.*key|key.*cert"):
        Store(tls_etcd.endpoint, ca_cert=str(p.ca), cert=str(p.client_cert))
    with pytest.raises(ValueError, match="password"):
        Store(tls_etcd.endpoint, ca_cert=str(p.ca), password=PASSWORD)


def test_user_and_password_over_tls(tls_etcd: TlsEtcd) -> None:
    enable_auth(tls_etcd)
    ep = tls_etcd.endpoint
    root = tls_etcd.tls_store(user="root", password=PASSWORD)
    root.put("/k", "v")
    assert root.get("/k") is not None
    _fenced_txn(root)
    lease = root.lease_grant(5)
    assert root.lease_refresh(lease) > 0
    w = root.watch_prefix("/w/")
    try:
        root.put("/w/a", "1")
        ev = w.get(timeout=5)
        assert ev is not None and ev.key == "/w/a"
    finally:
        w.cancel()

    # wrong password: refused, the message names the endpoint and the user, not the password
    bad = tls_etcd.tls_store(user="root", password="wrong-" + PASSWORD)
    with pytest.raises(EtcdError) as ei:
        bad.get("/k")
    msg = str(ei.value)
    assert ep in msg and "'root'" in msg and "password" in msg, msg
    assert PASSWORD not in msg and "wrong-" not in msg
    assert not isinstance(ei.value, EtcdUnavailable)  # not retried as if etcd were down

    # certificate only (its CN is not a user): authenticated by TLS, but not authorised
    msg = _refused(tls_etcd.tls_store())
    assert ep in msg and ("user" in msg or "permission" in msg.lower()), msg


def test_auth_token_renewed_after_etcd_restart(tls_etcd: TlsEtcd) -> None:
    """etcd's simple auth tokens die with the server: the Store must log in again, not fail forever."""
    enable_auth(tls_etcd)
    s = tls_etcd.tls_store(user="root", password=PASSWORD, retry_window=15.0)
    s.put("/k", "1")
    w = s.watch_prefix("/k")
    token_before = s._metadata
    tls_etcd.proc.stop()
    argv_proc = tls_etcd.proc
    assert not argv_proc.alive()
    # same data dir, same flags
    tls_etcd.proc = ManagedProcess.spawn("etcd:tls", _argv_of(argv_proc), tls_etcd.log)
    deadline = time.monotonic() + 20
    while not port_open("127.0.0.1", tls_etcd.port):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    s.put("/k", "2")
    kv = s.get("/k")
    assert kv is not None and kv.value == b"2"
    assert s._metadata is not None and s._metadata != token_before  # logged in again
    try:  # a watch opened before the restart resumes and sees the change
        ev = w.get(timeout=15)
        seen = f"reconnects {w.reconnects}, last revision {w.last_revision}, thread alive {w._thread.is_alive()}"
        assert ev is not None and (ev.key, ev.value) == ("/k", b"2"), seen
    finally:
        w.cancel()


def _argv_of(proc: ManagedProcess) -> list[str]:
    assert proc.popen is not None
    return list(proc.popen.args)  # type: ignore[arg-type]


def test_secrets_are_never_shown(tls_etcd: TlsEtcd, caplog: pytest.LogCaptureFixture) -> None:
    enable_auth(tls_etcd)
    p = tls_etcd.pki
    key_text = p.client_key.read_text().splitlines()[1]
    good = tls_etcd.tls_store(user="root", password=PASSWORD)
    bad = tls_etcd.tls_store(user="root", password=PASSWORD + "x")
    for s in (good, bad):
        for text in (repr(s), str(s)):
            assert PASSWORD not in text and key_text not in text
            assert tls_etcd.endpoint in text and "root" in text
    with caplog.at_level("DEBUG"), pytest.raises(EtcdError) as ei:
        bad.get("/k")
    shown = str(ei.value) + repr(ei.value) + caplog.text
    assert PASSWORD not in shown and key_text not in shown


def test_credentials_from_environment(tls_etcd: TlsEtcd, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers build ``Store(endpoints)`` only: TLS and auth come from RRL_ETCD_* in their environment."""
    enable_auth(tls_etcd)
    p = tls_etcd.pki
    monkeypatch.setenv("RRL_ETCD_CA", str(p.ca))
    monkeypatch.setenv("RRL_ETCD_CERT", str(p.client_cert))
    monkeypatch.setenv("RRL_ETCD_KEY", str(p.client_key))
    monkeypatch.setenv("RRL_ETCD_USER", "root")
    monkeypatch.setenv("RRL_ETCD_PASSWORD", PASSWORD)
    s = tls_etcd.store()
    s.put("/env", "ok")
    assert PASSWORD not in repr(s)
    # an explicit argument wins over the environment
    with pytest.raises(EtcdError, match="password"):
        tls_etcd.store(password="nope").get("/env")


def test_cli_uses_tls_and_auth(tls_etcd: TlsEtcd, tmp_path: Path) -> None:
    """`rrl list` against the secured etcd: refused without credentials, works with RRL_ETCD_* set."""
    from tests.conftest import run_rrl

    enable_auth(tls_etcd)
    p = tls_etcd.pki
    base = {"RRL_HOME": str(tmp_path / "home"), "RRL_ETCD": tls_etcd.endpoint}
    for k in ("RRL_ETCD_CA", "RRL_ETCD_CERT", "RRL_ETCD_KEY", "RRL_ETCD_USER", "RRL_ETCD_PASSWORD", "RRL_API"):
        os.environ.pop(k, None)
    r = run_rrl("list", env=base)
    assert r.returncode == 1 and "TLS" in r.stderr and tls_etcd.endpoint in r.stderr, r.stderr
    env = {
        **base,
        "RRL_ETCD_CA": str(p.ca),
        "RRL_ETCD_CERT": str(p.client_cert),
        "RRL_ETCD_KEY": str(p.client_key),
        "RRL_ETCD_USER": "root",
        "RRL_ETCD_PASSWORD": PASSWORD,
    }
    r = run_rrl("list", "-o", "json", env=env)
    assert r.returncode == 0, r.stderr
    r = run_rrl("list", env={**env, "RRL_ETCD_PASSWORD": "wrong"})
    assert r.returncode == 1 and "password" in r.stderr and PASSWORD not in r.stderr + r.stdout, r.stderr


def test_rrl_controller_takes_tls_and_auth_flags(tls_etcd: TlsEtcd, tmp_path: Path) -> None:
    """`rrl controller --etcd-ca/--etcd-cert/--etcd-key/--etcd-user --etcd-password-file` leads and
    registers against the secured etcd; its log never shows the password."""
    import sys

    from controller import service

    enable_auth(tls_etcd)
    p = tls_etcd.pki
    pw = tmp_path / "etcd-password"
    pw.write_text(PASSWORD + "\n")
    pw.chmod(0o600)
    rrl = Path(sys.executable).parent / "rrl"
    argv = [
        str(rrl), "controller", "--etcd", tls_etcd.endpoint, "--id", "sec-0",
        "--token-file", str(tmp_path / "token"),
        "--etcd-ca", str(p.ca), "--etcd-cert", str(p.client_cert), "--etcd-key", str(p.client_key),
        "--etcd-user", "root", "--etcd-password-file", str(pw),
    ]  # fmt: skip
    env_keys = ("RRL_ETCD_CA", "RRL_ETCD_CERT", "RRL_ETCD_KEY", "RRL_ETCD_USER", "RRL_ETCD_PASSWORD")
    saved = {k: os.environ.pop(k) for k in env_keys if k in os.environ}
    log = tmp_path / "ctl.log"
    proc = ManagedProcess.spawn("ctl", argv, log, env={"RRL_HOME": str(tmp_path / "home")})
    os.environ.update(saved)
    try:
        store = tls_etcd.tls_store(user="root", password=PASSWORD)
        deadline = time.monotonic() + 60

        # it registers as a standby first, then campaigns: wait for both its page and its leadership
        def leading() -> bool:
            leader = store.get("/rrl/v1/leader")
            served = [c for c in service.controllers(store) if c.get("http")]
            return bool(served) and leader is not None and leader.value == b"sec-0"

        while not leading():
            assert proc.alive(), log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        proc.stop()
    assert PASSWORD not in log.read_text()


def test_a_slow_login_does_not_hold_the_store_lock(tls_etcd: TlsEtcd) -> None:
    """The Authenticate RPC runs outside the Store lock: while one thread's login waits on a
    stalled etcd, another can still drop a channel or close the store at once."""
    import os
    import signal
    import threading

    enable_auth(tls_etcd)
    s = tls_etcd.tls_store(user="root", password=PASSWORD, timeout=3.0, retry_window=10.0)
    s.put("/k", "1")
    s._drop_token(s._metadata)  # the next call logs in again
    pid = tls_etcd.proc.pid
    got: list[object] = []
    os.kill(pid, signal.SIGSTOP)
    try:
        caller = threading.Thread(target=lambda: got.append(s.get("/k")))
        caller.start()
        time.sleep(0.5)  # the caller is in its login now
        t0 = time.monotonic()
        s._rotate(None)  # takes the Store lock
        took = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    caller.join(20)
    assert took < 0.5, f"the Store lock was held for {took:.1f}s by a login"
    assert got and got[0].value == b"1"  # type: ignore[attr-defined]
