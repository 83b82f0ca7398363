"""TLS contexts of ``pdlink serve`` and ``pdlink.client`` (standard library ``ssl`` only).

* TLS 1.3 only, on both sides (the minimum and maximum version are 1.3).
* Server: when the plane has CA files, a client must present a certificate signed by one of them
  (mutual TLS, ``CERT_REQUIRED``); CRL files, when present, are checked for the client's
  certificate. Encrypted private keys are refused with a clear error (MindIE's key-password
  files are KMC-encrypted, which pdlink cannot read).
* Client (as MindIE's controller): verifies the server's chain against the given CA, presents
  its certificate, and does not check the host name unless asked.
"""

from __future__ import annotations

import ssl

from .config import ConfigError, TlsFiles

__all__ = ["server_context", "client_context"]


def _no_password() -> str:
    raise ConfigError("the private key is encrypted; pdlink serve needs an unencrypted key file "
                      "(protect it with file permissions, mode 0600)")


def _tls13(ctx: ssl.SSLContext) -> ssl.SSLContext:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def server_context(tls: TlsFiles, plane: str = "management") -> ssl.SSLContext:
    """A TLS 1.3 server context for ``tls``; ``ConfigError`` naming the file when one is unusable."""
    ctx = _tls13(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    try:
        ctx.load_cert_chain(tls.cert, tls.key, password=_no_password)
    except ConfigError as e:
        raise ConfigError(f"{plane} plane: {tls.key}: {e}") from None
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"{plane} plane: cannot load certificate {tls.cert} with key {tls.key}: {e}") from None
    if tls.ca_files:
        for ca in tls.ca_files:
            try:
                ctx.load_verify_locations(cafile=ca)
            except (ssl.SSLError, OSError) as e:
                raise ConfigError(f"{plane} plane: cannot load CA file {ca}: {e}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
        for crl in tls.crl_files:
            try:
                ctx.load_verify_locations(cafile=crl)
            except (ssl.SSLError, OSError) as e:
                raise ConfigError(f"{plane} plane: cannot load CRL file {crl}: {e}") from None
        if tls.crl_files:
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return ctx


def client_context(ca: str | None = None, cert: str | None = None, key: str | None = None,
                   check_hostname: bool = False) -> ssl.SSLContext:
    """A TLS 1.3 client context: trust ``ca`` (the system store when None), present ``cert`` /
    ``key`` when given, check the host name only when ``check_hostname``."""
    ctx = _tls13(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
    ctx.check_hostname = check_hostname
    ctx.verify_mode = ssl.CERT_REQUIRED
    if ca:
        ctx.load_verify_locations(cafile=ca)
    else:
        ctx.load_default_certs()
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx
