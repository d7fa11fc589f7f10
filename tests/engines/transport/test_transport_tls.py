"""Transport TLS over real loopback sockets, with a throwaway CA made by the `openssl`
command line: transfers are bit-exact inside TLS (HMAC handshake included, zero-copy reads
and TCP_INFO kept), a decode that does not trust the prefill's certificate (or that the
prefill does not trust, with mutual TLS) fails at once with a TransferError saying so, and a
plain end against a TLS end fails within its timeouts, naming TLS, without wedging either
side. Certificate files that are missing or do not load are errors naming them."""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transport_helpers import Pair, assert_same, layer_kind, make_pair, random_arrays

from prfaas.engines.transport import (
    KVReceiver,
    KVSender,
    ReceiverConfig,
    SenderConfig,
    TlsConfig,
    TransferError,
)
from prfaas.testing.tls_certs import CertAuthority, IssuedCert

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32


@dataclass(frozen=True)
class Certs:
    ca: CertAuthority
    prefill: IssuedCert
    decode: IssuedCert
    rogue_ca: CertAuthority
    rogue: IssuedCert
    """Signed by `rogue_ca`, which the deployment does not trust."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    ca = CertAuthority.create(tmp_path_factory.mktemp("ca"))
    rogue_ca = CertAuthority.create(tmp_path_factory.mktemp("rogue"), "rogue-ca")
    return Certs(ca, ca.issue("prefill"), ca.issue("decode"), rogue_ca, rogue_ca.issue("x"))


def serving(cert: IssuedCert, ca: CertAuthority | None = None, **sender: Any) -> SenderConfig:
    """A sender serving `cert`; with `ca`, it requires client certificates signed by it."""
    tls = TlsConfig(cert.cert, cert.key, ca.cert if ca else None, verify_client=ca is not None)
    return SenderConfig(auth_key=KEY, tls=tls, **sender)


def trusting(ca: CertAuthority, cert: IssuedCert | None = None, **tls: Any) -> ReceiverConfig:
    """A receiver trusting `ca` (presenting `cert` when asked)."""
    cert_file, key_file = (cert.cert, cert.key) if cert else (None, None)
    return ReceiverConfig(auth_key=KEY, tls=TlsConfig(cert_file, key_file, ca.cert, **tls))


async def _round_trip(pair: Pair, room: int, layers: int = 6) -> None:
    sent = [random_arrays(np.random.default_rng(room * 10 + i), scale=40) for i in range(layers)]
    handle = pair.sender.open(room)
    transfer = await pair.receiver.fetch("127.0.0.1", pair.port, room, timeout_s=20)
    for layer, arrays in enumerate(sent):
        handle.send_layer(layer, layer_kind(layer), arrays)
    handle.send_aux("meta", b'{"first_token": 7}')
    handle.finish()
    result = await transfer.complete()
    await handle.wait()
    assert [item.layer for item in result.layers] == list(range(layers))
    for item, arrays in zip(result.layers, sent, strict=True):
        assert_same(arrays, item.arrays)
    assert result.aux == {"meta": b'{"first_token": 7}'}


async def test_a_transfer_over_tls_is_bit_exact(certs: Certs) -> None:
    """Striped over 4 TLS 1.3 connections (small frames, so every connection carries some),
    with the HMAC handshake inside TLS: layers arrive bit-exact through the zero-copy reader
    (a BufferedProtocol: the TLS layer decrypts into the buffer it names; the reader has no
    `data_received` to fall back on), and the sender's TCP_INFO telemetry still reads the
    sockets under TLS."""
    pair = await make_pair(serving(certs.prefill, chunk_bytes=4096), trusting(certs.ca))
    try:
        await _round_trip(pair, 1)
        await _round_trip(pair, 2)
        link = next(iter(pair.receiver._links.values()))
        assert len(link.conns) == 4
        for conn in link.conns.values():
            assert conn.transport is not None
            tls = conn.transport.get_extra_info("ssl_object")
            assert isinstance(tls, ssl.SSLObject) and tls.version() == "TLSv1.3"
        telemetry = pair.sender.telemetry()
        assert len(telemetry.connections) == 4 and telemetry.rtt_s is not None
        assert all(c.rtt_s is not None and c.segments_out for c in telemetry.connections)
        assert {c.tls for c in telemetry.connections} == {"TLSv1.3"}
        assert sum(c.bytes_sent for c in telemetry.connections) > 6 * 40 * 64
        assert telemetry.handshake_failures == 0
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_mutual_tls(certs: Certs) -> None:
    """With `verify_client`, a decode presenting a certificate of the deployment's CA gets
    its KV; one without a certificate, or with a certificate of another CA, is closed during
    the handshake and its fetch fails at its timeout saying why that may be (asyncio's TLS
    server sends no alert, so the decode cannot tell for sure); the prefill's rooms fail at
    their register timeout and it keeps serving the trusted decode."""
    sender = serving(certs.prefill, certs.ca, register_timeout_s=1.0)
    pair = await make_pair(sender, trusting(certs.ca, certs.decode))
    strangers = [KVReceiver(trusting(certs.ca)), KVReceiver(trusting(certs.ca, certs.rogue))]
    try:
        await _round_trip(pair, 4)
        for room, receiver in enumerate(strangers, start=5):
            handle = pair.sender.open(room)
            transfer = await receiver.fetch("127.0.0.1", pair.port, room, timeout_s=1.5)
            async with asyncio.timeout(10):
                with pytest.raises(TransferError, match="closes an untrusted one so"):
                    await transfer.complete()
                with pytest.raises(TransferError, match="no decode peer registered"):
                    await handle.wait()
        await _round_trip(pair, 7)
        assert pair.sender.telemetry().peers == 1
    finally:
        for receiver in strangers:
            await receiver.close()
        await pair.receiver.close()
        await pair.sender.close()


@pytest.mark.parametrize("case", ["other CA", "other name"])
async def test_an_untrusted_prefill_certificate_fails_the_fetch(certs: Certs, case: str) -> None:
    """A decode that does not trust the prefill's certificate (signed by a CA it does not
    know, or not naming the host it expects) never sends it a byte of the protocol: its
    fetch fails at once, not at its 30 s timeout, with a TransferError naming the
    certificate; the prefill's room fails at its register timeout."""
    if case == "other CA":
        sender, receiver = serving(certs.rogue), trusting(certs.ca)
        reason = "certificate is not trusted: unable to get local issuer certificate"
    else:
        sender, receiver = serving(certs.prefill), trusting(certs.ca, server_name="kv.example")
        reason = "certificate is not trusted: Hostname mismatch"
    pair = await make_pair(dataclasses.replace(sender, register_timeout_s=1.0), receiver)
    try:
        handle = pair.sender.open(9)
        transfer = await pair.receiver.fetch("127.0.0.1", pair.port, 9, timeout_s=30)
        async with asyncio.timeout(10):
            with pytest.raises(TransferError, match=f"room 9: sender 127.0.0.1:.*{reason}"):
                await transfer.complete()
            with pytest.raises(TransferError, match="no decode peer registered"):
                await handle.wait()
        assert pair.sender.telemetry().peers == 0
    finally:
        await pair.receiver.close()
        await pair.sender.close()


async def test_plain_and_tls_ends_do_not_talk(certs: Certs) -> None:
    """A plain decode against a TLS prefill, and a TLS decode against a plain prefill: each
    fetch fails within its timeout naming transport TLS, each prefill room within its
    register timeout, and both prefills then serve a matching decode as usual."""
    tls_sender = KVSender(serving(certs.prefill, register_timeout_s=1.0))
    plain_sender = KVSender(SenderConfig(auth_key=KEY, register_timeout_s=1.0))
    plain, tls = KVReceiver(ReceiverConfig(auth_key=KEY)), KVReceiver(trusting(certs.ca))
    try:
        await tls_sender.start()
        await plain_sender.start()
        cases = [
            (tls_sender, plain, "a sender that serves transport TLS closes a plain connection"),
            (plain_sender, tls, "TLS handshake failed .*does the sender serve transport TLS"),
        ]
        for sender, receiver, reason in cases:
            handle = sender.open(11)
            transfer = await receiver.fetch("127.0.0.1", sender.bootstrap_port, 11, timeout_s=1.5)
            async with asyncio.timeout(10):
                with pytest.raises(TransferError, match=f"timed out after 1.5 s.*{reason}"):
                    await transfer.complete()
                with pytest.raises(TransferError, match="no decode peer registered"):
                    await handle.wait()
        assert plain_sender.telemetry().handshake_failures >= 1
        await _round_trip(Pair(tls_sender, tls), 12)
        await _round_trip(Pair(plain_sender, plain), 12)
        assert {c.tls for c in plain_sender.telemetry().connections} == {None}
    finally:
        for receiver in (plain, tls):
            await receiver.close()
        for sender in (tls_sender, plain_sender):
            await sender.close()


def test_tls_runs_on_uvloop(certs: Certs) -> None:
    """The gateway's uvloop: a TLS transfer, every receiver connection reset, a second
    transfer, with TCP_INFO telemetry; an untrusted certificate fails at once there too."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        pair = await make_pair(serving(certs.prefill, chunk_bytes=4096), trusting(certs.ca))
        untrusted = KVReceiver(trusting(certs.rogue_ca))
        try:
            await _round_trip(pair, 1)
            for conn in list(next(iter(pair.receiver._links.values())).conns.values()):
                assert conn.transport is not None
                conn.transport.abort()
            await _round_trip(pair, 2)
            assert pair.sender.telemetry().rtt_s is not None
            transfer = await untrusted.fetch("127.0.0.1", pair.port, 3, timeout_s=30)
            async with asyncio.timeout(10):
                with pytest.raises(TransferError, match="certificate is not trusted"):
                    await transfer.complete()
        finally:
            await untrusted.close()
            await pair.receiver.close()
            await pair.sender.close()

    uvloop.run(scenario())


def test_certificate_files_are_checked(certs: Certs, tmp_path: Path) -> None:
    """A missing file, a directory, a cert without its key, a sender without a certificate,
    a key that is not the certificate's, and a CA file that is not PEM: each is a ValueError
    naming the file or the setting."""
    missing = tmp_path / "nope.pem"
    with pytest.raises(ValueError, match=f"certificate '{missing}' cannot be read: No such"):
        TlsConfig(missing, certs.prefill.key)
    with pytest.raises(ValueError, match=f"CA file '{tmp_path}' cannot be read: Is a dir"):
        TlsConfig(ca_file=tmp_path)
    with pytest.raises(ValueError, match="cert_file and key_file go together"):
        TlsConfig(cert_file=certs.prefill.cert)
    with pytest.raises(ValueError, match="verify_client needs a ca_file"):
        TlsConfig(certs.prefill.cert, certs.prefill.key, verify_client=True)
    with pytest.raises(ValueError, match=r"a TLS sender needs tls\.cert_file"):
        SenderConfig(tls=TlsConfig(ca_file=certs.ca.cert))
    wrong = TlsConfig(certs.prefill.cert, certs.decode.key)
    with pytest.raises(ValueError, match=f"certificate '{certs.prefill.cert}' with key .*does "):
        wrong.server_context()
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=f"CA file '{garbage}' does not load"):
        KVReceiver(ReceiverConfig(tls=TlsConfig(ca_file=garbage)))


async def test_a_sender_with_a_bad_key_does_not_start(certs: Certs) -> None:
    """`start()` raises the naming ValueError before binding anything."""
    sender = KVSender(SenderConfig(tls=TlsConfig(certs.prefill.cert, certs.rogue.key)))
    with pytest.raises(ValueError, match="does not load"):
        await sender.start()
