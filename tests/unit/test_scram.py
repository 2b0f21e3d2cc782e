"""SCRAM client (RFC 5802/7677) and the SASL exchange, at the protocol level."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from shmprod.errors import AuthenticationError, DecodeError
from shmprod.protocol.frames import ApiKey
from shmprod.protocol.messages import (
    ApiVersionsResponse,
    SaslAuthenticateRequest,
    SaslAuthenticateResponse,
    SaslHandshakeRequest,
    SaslHandshakeResponse,
    decode_body,
    encode_body,
)
from shmprod.protocol.sasl_exchange import SaslCredentials, SaslExchange
from shmprod.protocol.scram import (
    ScramClient,
    escape_username,
    parse_server_final,
    parse_server_first,
)

# RFC 7677 section 3: SCRAM-SHA-256, user "user", password "pencil".
CLIENT_NONCE = "rOprNGfwEbeRWgbNEkqO"
CLIENT_FIRST = b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
SERVER_FIRST = (
    b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
)
CLIENT_FINAL = (
    b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
    b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
)
SERVER_FINAL = b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="

OFFERED = {ApiKey.SASL_HANDSHAKE: (0, 1), ApiKey.SASL_AUTHENTICATE: (0, 2)}


def test_rfc7677_scram_sha_256_vector() -> None:
    c = ScramClient("SCRAM-SHA-256", "user", "pencil", nonce=CLIENT_NONCE)
    assert c.first() == CLIENT_FIRST
    assert c.final(SERVER_FIRST) == CLIENT_FINAL
    c.verify(SERVER_FINAL)
    assert c.done
    assert "pencil" not in repr(c)


def test_scram_sha_512_against_the_formulas() -> None:
    """SHA-512 has no RFC vector: check the proof against RFC 5802's definitions."""
    c = ScramClient("SCRAM-SHA-512", "u,=x", "pw", nonce="abc")
    assert c.first() == b"n,,n=u=2C=3Dx,r=abc"
    salt = b"0123456789abcdef"
    server_first = b"r=abcXYZ,s=" + base64.b64encode(salt) + b",i=4096"
    final = c.final(server_first)
    salted = hashlib.pbkdf2_hmac("sha512", b"pw", salt, 4096)
    client_key = hmac.new(salted, b"Client Key", "sha512").digest()
    stored = hashlib.sha512(client_key).digest()
    auth = b"n=u=2C=3Dx,r=abc," + server_first + b",c=biws,r=abcXYZ"
    sig = hmac.new(stored, auth, "sha512").digest()
    proof = bytes(a ^ b for a, b in zip(client_key, sig, strict=True))
    assert final == b"c=biws,r=abcXYZ,p=" + base64.b64encode(proof)
    server_sig = hmac.new(hmac.new(salted, b"Server Key", "sha512").digest(), auth, "sha512")
    c.verify(b"v=" + base64.b64encode(server_sig.digest()))


@pytest.mark.parametrize(
    ("server_first", "error"),
    [
        (b"r=someoneelse,s=AAAA,i=4096", AuthenticationError),  # nonce not ours
        (b"r=" + CLIENT_NONCE.encode() + b",s=AAAA,i=4096", AuthenticationError),  # not extended
        (b"r=" + CLIENT_NONCE.encode() + b"x,s=AAAA,i=100", AuthenticationError),  # too few
        (b"m=ext,r=x,s=AAAA,i=4096", AuthenticationError),
        (b"e=unknown-user", AuthenticationError),
        (b"r=" + CLIENT_NONCE.encode() + b"x,s=!!,i=4096", DecodeError),
        (b"r=" + CLIENT_NONCE.encode() + b"x,i=4096,s=AAAA", DecodeError),
        (b"r=" + CLIENT_NONCE.encode() + b"x,s=AAAA,i=-1", DecodeError),
        (b"\xff\xfe", DecodeError),
        (b"", DecodeError),
    ],
)
def test_bad_server_first(server_first: bytes, error: type[Exception]) -> None:
    c = ScramClient("SCRAM-SHA-256", "user", "pencil", nonce=CLIENT_NONCE)
    c.first()
    with pytest.raises(error):
        c.final(server_first)


def test_server_final_errors_and_wrong_signature() -> None:
    for final, error in (
        (b"e=invalid-proof", AuthenticationError),
        (b"v=" + base64.b64encode(b"x" * 32), AuthenticationError),
        (b"x=1", DecodeError),
    ):
        c = ScramClient("SCRAM-SHA-256", "user", "pencil", nonce=CLIENT_NONCE)
        c.first()
        c.final(SERVER_FIRST)
        with pytest.raises(error):
            c.verify(final)
    with pytest.raises(AuthenticationError, match="unknown-user"):
        parse_server_final(b"e=unknown-user")
    assert parse_server_first(SERVER_FIRST).iterations == 4096
    assert escape_username("a=b,c") == "a=3Db=2Cc"


def test_steps_out_of_order() -> None:
    c = ScramClient("SCRAM-SHA-256", "user", "pencil", nonce=CLIENT_NONCE)
    with pytest.raises(AuthenticationError):
        c.final(SERVER_FIRST)
    with pytest.raises(AuthenticationError):
        c.verify(SERVER_FINAL)
    with pytest.raises(ValueError):
        ScramClient("SCRAM-SHA-1", "u", "p")


# ---------------------------------------------------------------------------
# SaslExchange
# ---------------------------------------------------------------------------


def test_scram_exchange_with_the_rfc_vector() -> None:
    creds = SaslCredentials("SCRAM-SHA-256", "user", "pencil")
    assert "pencil" not in repr(creds)
    ex = SaslExchange(creds, OFFERED, "b:1", nonce=CLIENT_NONCE)
    step = ex.start()
    assert step.request == SaslHandshakeRequest(mechanism="SCRAM-SHA-256")
    assert step.version == 1
    ok = SaslHandshakeResponse(error_code=0, mechanisms=["SCRAM-SHA-256"])
    step2 = ex.on_response(ok)
    assert step2 is not None and step2.version == 2
    assert isinstance(step2.request, SaslAuthenticateRequest)
    assert bytes(step2.request.auth_bytes) == CLIENT_FIRST
    step3 = ex.on_response(SaslAuthenticateResponse(auth_bytes=SERVER_FIRST))
    assert step3 is not None and isinstance(step3.request, SaslAuthenticateRequest)
    assert bytes(step3.request.auth_bytes) == CLIENT_FINAL
    assert ex.on_response(SaslAuthenticateResponse(auth_bytes=SERVER_FINAL)) is None
    assert ex.done
    with pytest.raises(AuthenticationError):
        ex.on_response(SaslAuthenticateResponse())


def test_plain_exchange() -> None:
    ex = SaslExchange(SaslCredentials("PLAIN", "alice", "s3cret"), OFFERED, "b:1")
    ex.start()
    step = ex.on_response(SaslHandshakeResponse(mechanisms=["PLAIN"]))
    assert step is not None and isinstance(step.request, SaslAuthenticateRequest)
    assert bytes(step.request.auth_bytes) == b"\0alice\0s3cret"
    assert ex.on_response(SaslAuthenticateResponse()) is None


def test_exchange_refusals() -> None:
    creds = SaslCredentials("SCRAM-SHA-512", "alice", "pw")
    ex = SaslExchange(creds, OFFERED, "b:1")
    ex.start()
    with pytest.raises(AuthenticationError, match="offers: PLAIN"):
        ex.on_response(SaslHandshakeResponse(error_code=33, mechanisms=["PLAIN"]))
    ex = SaslExchange(creds, OFFERED, "b:1")
    ex.start()
    ex.on_response(SaslHandshakeResponse(mechanisms=["SCRAM-SHA-512"]))
    refused = SaslAuthenticateResponse(error_code=58, error_message="Authentication failed")
    with pytest.raises(AuthenticationError, match="SASL_AUTHENTICATION_FAILED") as info:
        ex.on_response(refused)
    assert info.value.code == -1013 and not info.value.retriable
    assert "pw" not in str(info.value).replace("alice", "")
    with pytest.raises(AuthenticationError, match="SaslHandshake v1"):
        SaslExchange(creds, {ApiKey.SASL_AUTHENTICATE: (0, 2)}, "b:1")
    with pytest.raises(AuthenticationError, match="SaslAuthenticate"):
        SaslExchange(creds, {ApiKey.SASL_HANDSHAKE: (0, 1)}, "b:1")
    with pytest.raises(AuthenticationError, match="unsupported SASL mechanism"):
        SaslExchange(SaslCredentials("GSSAPI", "a", "b"), OFFERED, "b:1")
    ex = SaslExchange(creds, OFFERED, "b:1")
    with pytest.raises(AuthenticationError):
        ex.on_response(SaslAuthenticateResponse())
    with pytest.raises(AuthenticationError):
        ex.on_response(ApiVersionsResponse())


@pytest.mark.parametrize(
    ("msg", "version", "wire"),
    [
        (SaslHandshakeRequest(mechanism="PLAIN"), 1, "0005 504c41494e"),
        (SaslAuthenticateRequest(auth_bytes=b"ab"), 1, "00000002 6162"),
        (SaslAuthenticateRequest(auth_bytes=b"ab"), 2, "03 6162 00"),
        (
            SaslAuthenticateResponse(
                error_code=58, error_message=None, auth_bytes=b"", session_lifetime_ms=1
            ),
            1,
            "003a ffff 00000000 0000000000000001",
        ),
        (SaslHandshakeResponse(error_code=33, mechanisms=["A"]), 1, "0021 00000001 0001 41"),
    ],
)
def test_bytes_by_hand(msg: object, version: int, wire: str) -> None:
    body = encode_body(msg, version)  # type: ignore[arg-type]
    assert body == bytes.fromhex(wire.replace(" ", ""))
    assert decode_body(type(msg), body, version) == msg  # type: ignore[arg-type]
