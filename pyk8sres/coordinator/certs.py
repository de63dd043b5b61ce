"""The webhook's certificates: the one it serves (its own CA's, made and
renewed here, or cert-manager's files), and the CA of the client
certificate the API server presents, without which nobody may ask.

Our own CA and serving certificate live under cert_dir, kept across
restarts.  The serving certificate is renewed at 2/3 of its life; the CA
too, in two steps (the new CA joins the bundle first, serving certificates
switch to it once the API server had time to see it).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path
from urllib.parse import urlparse

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .config import ConfigError, WebhookConfig


def _pem_cert(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class Certs:
    """Our own CA and serving certificate under a directory (kept across restarts).

    Files: ca.crt/ca.key (signing), next-ca.* (rotation in progress),
    prev-ca.crt (still trusted until it expires), tls.crt/tls.key (served).
    """

    def __init__(self, directory: str, dns_names, ips, cert_days: float, ca_days: float,
                 promote_seconds: float):
        self.dir = Path(directory)
        self.dns = sorted(set(dns_names))
        self.ips = sorted(set(ips))
        self.cert_life = dt.timedelta(days=cert_days)
        self.ca_life = dt.timedelta(days=ca_days)
        self.promote = dt.timedelta(seconds=promote_seconds)
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)

    @property
    def cert_file(self) -> str:
        return str(self.dir / "tls.crt")

    @property
    def key_file(self) -> str:
        return str(self.dir / "tls.key")

    def _load(self, name: str):
        crt, key = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        if not crt.exists():
            return None, None
        cert = x509.load_pem_x509_certificate(crt.read_bytes())
        k = serialization.load_pem_private_key(key.read_bytes(), None) if key.exists() else None
        return cert, k

    def _new_ca(self, now: dt.datetime):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                             f"pyk8sres webhook CA {now:%Y%m%d%H%M%S}")])
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - self._backdate(self.ca_life)).not_valid_after(now + self.ca_life)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return cert, key

    def _issue(self, ca, ca_key, now: dt.datetime) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        sans = [x509.DNSName(d) for d in self.dns] + [
            x509.IPAddress(ipaddress.ip_address(i)) for i in self.ips]
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, (self.dns or self.ips)[0])]))
                .issuer_name(ca.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - self._backdate(self.cert_life))
                .not_valid_after(min(now + self.cert_life, ca.not_valid_after_utc))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write(self.dir / "tls.key", _pem_key(key), 0o600)
        _write(self.dir / "tls.crt", _pem_cert(cert) + _pem_cert(ca))

    @staticmethod
    def _backdate(life: dt.timedelta) -> dt.timedelta:
        """How far before now a certificate starts (clock skew between hosts)."""
        return min(dt.timedelta(minutes=5), life / 10)

    @staticmethod
    def _aged(cert, now: dt.datetime) -> bool:
        """Past 2/3 of its life (time to renew)."""
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
        return now >= start + (end - start) * 2 / 3

    def ensure(self, now: dt.datetime | None = None) -> bool:
        """Create or renew what is due; True if the served files changed."""
        now = now or dt.datetime.now(dt.timezone.utc)
        changed = False
        ca, ca_key = self._load("ca")
        if ca is None or ca_key is None or now >= ca.not_valid_after_utc:
            ca, ca_key = self._new_ca(now)
            _write(self.dir / "ca.key", _pem_key(ca_key), 0o600)
            _write(self.dir / "ca.crt", _pem_cert(ca))
            changed = True
        nxt, nxt_key = self._load("next-ca")
        if nxt is None and self._aged(ca, now):
            nxt, nxt_key = self._new_ca(now)   # joins the bundle now, signs later
            _write(self.dir / "next-ca.key", _pem_key(nxt_key), 0o600)
            _write(self.dir / "next-ca.crt", _pem_cert(nxt))
            changed = True
        elif nxt is not None and now >= (nxt.not_valid_before_utc + self._backdate(self.ca_life)
                                         + self.promote):
            _write(self.dir / "prev-ca.crt", _pem_cert(ca))
            os.replace(self.dir / "next-ca.key", self.dir / "ca.key")
            os.replace(self.dir / "next-ca.crt", self.dir / "ca.crt")
            ca, ca_key = nxt, nxt_key
            changed = True
        served, _ = self._load("tls")
        if (served is None or changed or served.issuer != ca.subject or self._aged(served, now)
                or now >= served.not_valid_after_utc):
            self._issue(ca, ca_key, now)
            changed = True
        return changed

    def bundle(self, now: dt.datetime | None = None) -> bytes:
        """PEM of every CA a client must trust now (current, next, previous)."""
        now = now or dt.datetime.now(dt.timezone.utc)
        out = b""
        for name in ("ca", "next-ca", "prev-ca"):
            p = self.dir / f"{name}.crt"
            if p.exists():
                c = x509.load_pem_x509_certificate(p.read_bytes())
                if now < c.not_valid_after_utc:
                    out += _pem_cert(c)
        return out


def serving(wcfg: WebhookConfig) -> tuple[Certs | None, str, str]:
    """(our Certs, None with cert-manager's files; the certificate and key
    files to serve).  Our own are created or renewed now."""
    if wcfg.tls_cert_file:
        return None, wcfg.tls_cert_file, wcfg.tls_key_file or wcfg.tls_cert_file
    dns, ips = ["localhost", *wcfg.service_dns], ["127.0.0.1"]
    if wcfg.url:
        host = urlparse(wcfg.url).hostname or ""
        try:
            ipaddress.ip_address(host)
            ips.append(host)
        except ValueError:
            dns.append(host)
    certs = Certs(wcfg.cert_dir, dns, ips, wcfg.cert_days, wcfg.ca_days, wcfg.ca_promote_seconds)
    certs.ensure()
    return certs, certs.cert_file, certs.key_file


def client_ca(wcfg: WebhookConfig) -> str:
    """The CA file of the API server's client certificate: required, since
    only the API server may ask for a reservation."""
    if not wcfg.client_ca_file:
        raise ConfigError(
            "webhook: client_ca_file is required (the CA of the client certificate the "
            "API server presents to webhooks; docs/security.md)")
    return wcfg.client_ca_file
