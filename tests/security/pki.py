"""A throwaway CA issuing certificates with cluster roles (URI SANs `urn:pdserve:role:<role>`)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.server.security import ROLE_URI_PREFIX, TlsConfig


class Pki:
    def __init__(self, out: Path):
        self.out = out
        self.now = datetime.datetime.now(datetime.timezone.utc)
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve test CA")])
        ca = (x509.CertificateBuilder().subject_name(self.name).issuer_name(self.name)
              .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(self.now - datetime.timedelta(minutes=5))
              .not_valid_after(self.now + datetime.timedelta(days=1))
              .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
              .sign(self.key, hashes.SHA256()))
        self.ca = out / "ca.pem"
        self.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, roles: tuple[str, ...] = (), days: float = 1.0) -> TlsConfig:
        """A certificate for 127.0.0.1/localhost (server and client use) carrying `roles`."""
        key = ec.generate_private_key(ec.SECP256R1())
        sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                *(x509.UniformResourceIdentifier(f"{ROLE_URI_PREFIX}{r}") for r in roles)]
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(self.name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(self.now - datetime.timedelta(minutes=5))
                .not_valid_after(self.now + datetime.timedelta(days=days))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .sign(self.key, hashes.SHA256()))
        (self.out / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (self.out / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        return TlsConfig(self.out / f"{name}.pem", self.out / f"{name}.key", self.ca)


def tls_args(tls: TlsConfig) -> list[str]:
    return ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca", str(tls.ca)]
