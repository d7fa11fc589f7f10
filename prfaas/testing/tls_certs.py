"""A throwaway certificate authority for trying transport TLS: NOT for production keys.

It calls the `openssl` command line (no Python dependency; `make test` installs it and
names it in `$PRFAAS_OPENSSL`): one CA, and certificates it signs for `127.0.0.1` and
`localhost` (serverAuth and clientAuth, so one certificate serves an engine's bootstrap
listener and its fetches). Keys are unencrypted P-256, valid 2 days.
Tests and `benchmarks/transport.py --tls` use it; by hand:
`python -m prfaas.testing.tls_certs DIR [NAME ...]` writes `DIR/ca.pem` and `DIR/NAME.pem`,
`DIR/NAME.key` for each name (default: `engine`).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

HOSTS = "IP:127.0.0.1,DNS:localhost"
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class IssuedCert:
    """A certificate and its key, both PEM files."""

    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    """Run `openssl args` ($PRFAAS_OPENSSL, else `openssl` on the PATH); RuntimeError with
    its stderr when it fails or is missing."""
    binary = os.environ.get("PRFAAS_OPENSSL") or shutil.which("openssl")
    if binary is None:
        raise RuntimeError("the openssl command line is not installed (apt-get install openssl)")
    done = subprocess.run([binary, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()}")


@dataclass(frozen=True)
class CertAuthority:
    """A CA in a directory; `issue` signs certificates for the local host."""

    cert: Path
    key: Path

    @classmethod
    def create(cls, directory: Path, name: str = "prfaas-test-ca") -> CertAuthority:
        """A new self-signed CA: `directory/ca.pem` and `directory/ca.key`."""
        directory.mkdir(parents=True, exist_ok=True)
        ca = cls(directory / "ca.pem", directory / "ca.key")
        _openssl("req", "-x509", *_KEY, "-keyout", str(ca.key), "-out", str(ca.cert),
                 "-days", "2", "-subj", f"/CN={name}",
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
        return ca

    def issue(self, name: str, hosts: str = HOSTS) -> IssuedCert:
        """A certificate for `hosts` (subjectAltName syntax) next to the CA's files."""
        directory = self.cert.parent
        issued = IssuedCert(directory / f"{name}.pem", directory / f"{name}.key")
        request, extensions = directory / f"{name}.csr", directory / f"{name}.ext"
        extensions.write_text(f"subjectAltName={hosts}\nbasicConstraints=CA:FALSE\n"
                              "extendedKeyUsage=serverAuth,clientAuth\n")  # fmt: skip
        _openssl("req", *_KEY, "-keyout", str(issued.key), "-out", str(request),
                 "-subj", f"/CN={name}")  # fmt: skip
        _openssl("x509", "-req", "-in", str(request), "-CA", str(self.cert),
                 "-CAkey", str(self.key), "-set_serial", str(secrets.randbelow(2**62) + 1),
                 "-days", "2", "-out", str(issued.cert), "-extfile", str(extensions))  # fmt: skip
        request.unlink()
        extensions.unlink()
        return issued


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("names", nargs="*", default=["engine"])
    args = parser.parse_args(argv)
    ca = CertAuthority.create(args.directory)
    for name in args.names:
        issued = ca.issue(name)
        print(f"{name}: {issued.cert} {issued.key}")
    print(f"CA: {ca.cert}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
