"""The test cluster's certificates and credentials, laid out as kubeadm does:
one CA for the API server's serving certificate and every client certificate
(admin, controllers, kubelets, users), a second CA whose only client is the
API server calling the admission webhook, and the ServiceAccount token
signing key.  Everything is made once under a directory and reused.
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LIFE = datetime.timedelta(days=365)


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(cn: str, orgs=()) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
                     + [x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


class Authority:
    """A CA under `directory` as NAME.crt/NAME.key (made on first use), and
    the certificates it issued next to it."""

    def __init__(self, directory: str | os.PathLike, name: str, common_name: str):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.cert_file = str(self.dir / f"{name}.crt")
        key_file = self.dir / f"{name}.key"
        if not key_file.exists():
            key = ec.generate_private_key(ec.SECP256R1())
            now = datetime.datetime.now(datetime.timezone.utc)
            cert = (self._builder(_name(common_name), key.public_key(), now)
                    .issuer_name(_name(common_name))
                    .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                    .add_extension(x509.KeyUsage(True, False, False, False, False, True, True,
                                                 False, False), critical=True)
                    .sign(key, hashes.SHA256()))
            _write(key_file, _pem_key(key), 0o600)
            _write(Path(self.cert_file), cert.public_bytes(serialization.Encoding.PEM), 0o644)
        self.key = serialization.load_pem_private_key(key_file.read_bytes(), None)
        self.cert = x509.load_pem_x509_certificate(Path(self.cert_file).read_bytes())

    @staticmethod
    def _builder(subject: x509.Name, public_key, now: datetime.datetime) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(subject).public_key(public_key)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + LIFE))

    def issue(self, name: str, common_name: str, orgs=(), *, server_names=(),
              client: bool = True) -> tuple[str, str]:
        """(certificate, key) files NAME.crt/NAME.key: a client certificate for
        COMMON_NAME in groups ORGS, and a serving one for SERVER_NAMES."""
        crt, key_file = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        if not crt.exists():
            key = ec.generate_private_key(ec.SECP256R1())
            usages = ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else []) + \
                ([ExtendedKeyUsageOID.SERVER_AUTH] if server_names else [])
            builder = (self._builder(_name(common_name, orgs), key.public_key(),
                                     datetime.datetime.now(datetime.timezone.utc))
                       .issuer_name(self.cert.subject)
                       .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
            if server_names:
                builder = builder.add_extension(
                    x509.SubjectAlternativeName([_san(n) for n in server_names]), critical=False)
            cert = builder.sign(self.key, hashes.SHA256())
            _write(key_file, _pem_key(key), 0o600)
            _write(crt, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return str(crt), str(key_file)


def signing_key(directory: str | os.PathLike) -> tuple[str, str]:
    """(public, private) PEM files of the ServiceAccount token signing key."""
    d = Path(directory)
    private, public = d / "sa.key", d / "sa.pub"
    if not private.exists():
        key = ec.generate_private_key(ec.SECP256R1())
        _write(private, _pem_key(key), 0o600)
        _write(public, key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo), 0o644)
    return str(public), str(private)


def kubeconfig(path: str | os.PathLike, server: str, ca_file: str | None, user: str, *,
               cert: tuple[str, str] | None = None, token: str | None = None) -> str:
    """Write a kubeconfig (JSON, which is YAML) for one identity; returns its path.
    The credentials are inlined by path; the file is private (0600)."""
    creds: dict = {}
    if cert:
        creds = {"client-certificate": cert[0], "client-key": cert[1]}
    if token:
        creds = {"token": token}
    cluster = {"server": server, **({"certificate-authority": ca_file} if ca_file else {})}
    doc = {"apiVersion": "v1", "kind": "Config",
           "clusters": [{"name": "pyk8sres", "cluster": cluster}],
           "users": [{"name": user, "user": creds}],
           "contexts": [{"name": user, "context": {"cluster": "pyk8sres", "user": user}}],
           "current-context": user}
    _write(Path(path), (json.dumps(doc, indent=1) + "\n").encode(), 0o600)
    return str(path)
