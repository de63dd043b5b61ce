"""The webhook's own CA and serving certificate: made at start, renewed at
2/3 of their life, CA rotation in two steps (bundle first, then signing)."""

import ssl
from datetime import datetime, timedelta, timezone

from cryptography import x509

from pyk8sres.coordinator.certs import Certs

T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)


def served(c):
    return x509.load_pem_x509_certificates(open(c.cert_file, "rb").read())[0]


def cas(pem):
    return [x.subject.rfc4514_string() for x in x509.load_pem_x509_certificates(pem)]


def test_serving_certificate_verifies_against_bundle(tmp_path):
    c = Certs(str(tmp_path), ["localhost"], ["127.0.0.1"], cert_days=30, ca_days=300,
              promote_seconds=60)
    assert c.ensure(T0) is True
    assert c.ensure(T0) is False                       # nothing due: nothing changes
    cert = served(c)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    ca = x509.load_pem_x509_certificates(c.bundle(T0))[0]
    cert.verify_directly_issued_by(ca)
    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(c.cert_file, c.key_file)


def test_rotation(tmp_path):
    c = Certs(str(tmp_path), ["localhost"], [], cert_days=30, ca_days=300, promote_seconds=60)
    c.ensure(T0)
    first_serial, first_ca = served(c).serial_number, cas(c.bundle(T0))
    # serving cert renewed at 2/3 of 30 days, same CA
    t = T0 + timedelta(days=21)
    assert c.ensure(t) and served(c).serial_number != first_serial
    assert cas(c.bundle(t)) == first_ca
    # CA at 2/3 of 300 days: the next CA joins the bundle, the old one still signs
    t = T0 + timedelta(days=201)
    c.ensure(t)
    assert len(cas(c.bundle(t))) == 2 and served(c).issuer.rfc4514_string() == first_ca[0]
    # after the promotion delay the new CA signs; the old one stays trusted
    t2 = t + timedelta(minutes=10)
    assert c.ensure(t2)
    assert served(c).issuer.rfc4514_string() != first_ca[0]
    assert first_ca[0] in cas(c.bundle(t2)) and len(cas(c.bundle(t2))) == 2
    # once the old CA expired it leaves the bundle
    t3 = T0 + timedelta(days=301)
    assert first_ca[0] not in cas(c.bundle(t3))
