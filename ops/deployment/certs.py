"""Make the keys a secure Flower 1.39 deployment needs, with the ``cryptography`` package.

- A private certificate authority (``ca.crt``, ``ca.key``) and a SuperLink server
  certificate signed by it (``server.pem``, ``server.key``) whose subject alternative names
  list every host name and IP address SuperNodes, ``flwr`` and the SuperLink's own
  ServerApp process use to reach it (``localhost`` and ``127.0.0.1`` are always included,
  the SuperLink's runtime connects to itself on loopback). The SuperLink takes them as
  ``--ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile server.key``;
  SuperNodes as ``--root-certificates ca.crt``; ``flwr`` as ``root-certificates`` in
  ``$FLWR_HOME/config.toml``.
- SuperNode authentication key pairs (``supernode-<i>``, ``supernode-<i>.pub``): ECDSA on
  NIST P-384 in OpenSSH format, as ``ssh-keygen -t ecdsa -b 384 -N ""`` writes them.
  The public key is registered with ``flwr supernode register supernode-<i>.pub <conn>``,
  the SuperNode starts with ``--auth-supernode-private-key supernode-<i>``.

    python -m ops.deployment.certs --out certs --host <SUPERLINK_IP> --host superlink --supernodes 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("localhost", "127.0.0.1")
VALID_DAYS = 365


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the CA certificate and the SuperLink's certificate and key."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path


def subject_alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """``x509`` SAN entries: IP addresses as ``IPAddress``, everything else as ``DNSName``."""
    names: list[x509.GeneralName] = []
    seen: set[str] = set()
    for host in [*DEFAULT_HOSTS, *hosts]:
        host = host.strip()
        if not host or host in seen:
            continue
        if host.startswith("<") or " " in host:
            raise ValueError(f"{host!r} is not a host name or IP address (replace the placeholder)")
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _write_private(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    os.chmod(path, 0o600)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pflower"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_tls(out: Path, hosts: Sequence[str], days: int = VALID_DAYS) -> TlsFiles:
    """Create a CA and a server certificate for ``hosts`` (plus localhost/127.0.0.1) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("pflower CA")).issuer_name(_name("pflower CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    server_key = ec.generate_private_key(ec.SECP384R1())
    sans = subject_alt_names(hosts)
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(str(sans[-1].value))).issuer_name(ca_cert.subject)
        .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    files = TlsFiles(out / "ca.crt", out / "ca.key", out / "server.pem", out / "server.key")
    pem = serialization.Encoding.PEM
    files.ca_cert.write_bytes(ca_cert.public_bytes(pem))
    files.server_cert.write_bytes(server_cert.public_bytes(pem))
    pkcs8 = serialization.PrivateFormat.PKCS8
    _write_private(files.ca_key, ca_key.private_bytes(pem, pkcs8, serialization.NoEncryption()))
    _write_private(files.server_key, server_key.private_bytes(pem, pkcs8, serialization.NoEncryption()))
    return files


def make_node_keys(out: Path, name: str) -> tuple[Path, Path]:
    """One SuperNode auth key pair ``<name>`` (OpenSSH private) and ``<name>.pub``."""
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private = out / name
    public = out / f"{name}.pub"
    _write_private(private, key.private_bytes(serialization.Encoding.PEM,
                                              serialization.PrivateFormat.OpenSSH,
                                              serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH)
                       + f" {name}\n".encode())
    return private, public


def san_of(cert_path: Path) -> list[str]:
    """The subject alternative names of a PEM certificate, as strings."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(n.value) for n in ext]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.deployment.certs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="certs", help="output folder (default: certs)")
    p.add_argument("--host", action="append", default=[],
                   help="a host name or IP address of the SuperLink (repeatable); "
                        "localhost and 127.0.0.1 are always included")
    p.add_argument("--supernodes", type=int, default=0,
                   help="also make this many SuperNode auth key pairs supernode-0..N-1")
    p.add_argument("--days", type=int, default=VALID_DAYS)
    args = p.parse_args(argv)
    if args.supernodes < 0:
        p.error("--supernodes must be >= 0")
    out = Path(args.out)
    try:
        files = make_tls(out, args.host, args.days)
    except ValueError as err:
        print(f"make certs: {err}", file=sys.stderr)
        return 2
    print(f"CA {files.ca_cert}; SuperLink certificate {files.server_cert} for "
          f"{', '.join(san_of(files.server_cert))}; key {files.server_key}")
    for i in range(args.supernodes):
        private, public = make_node_keys(out, f"supernode-{i}")
        print(f"SuperNode key pair {private} / {public}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
