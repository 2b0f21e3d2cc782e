"""Fuzz the SASL decoders: SaslHandshake/SaslAuthenticate responses, SCRAM server
messages and the exchange driven by them (seeded, bounded, deterministic).

Every input must be accepted or raise :class:`DecodeError` (malformed) or
:class:`AuthenticationError` (well-formed refusal): never anything else, never a hang.
"""

from __future__ import annotations

import base64
import contextlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmprod.errors import AuthenticationError, ProtocolError
from shmprod.protocol.frames import ApiKey
from shmprod.protocol.messages import (
    SaslAuthenticateResponse,
    SaslHandshakeResponse,
    decode_body,
    encode_body,
)
from shmprod.protocol.sasl_exchange import SaslCredentials, SaslExchange
from shmprod.protocol.scram import ScramClient, parse_server_final, parse_server_first

pytestmark = pytest.mark.timeout(120)
SEED = 0x5A51
OFFERED = {ApiKey.SASL_HANDSHAKE: (0, 1), ApiKey.SASL_AUTHENTICATE: (0, 2)}
NONCE = "fuzzNonce"
ALLOWED = (ProtocolError, AuthenticationError)


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        if op == 0 and b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            del b[rng.randrange(len(b)) :]
        elif op == 2:
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3 and b:
            i = rng.randrange(len(b))
            b[i] = rng.choice(b",=rsiveam\xff\x00")
    return bytes(b)


def _valid_server_first() -> bytes:
    salt = base64.b64encode(b"salt-salt-salt").decode()
    return f"r={NONCE}server,s={salt},i=4096".encode()


@pytest.mark.parametrize("cls", [SaslHandshakeResponse, SaslAuthenticateResponse])
def test_response_decoders_seeded(cls: type[SaslHandshakeResponse]) -> None:
    rng = random.Random(SEED)
    samples = [
        encode_body(SaslHandshakeResponse(error_code=33, mechanisms=["PLAIN", "SCRAM"]), 1),
        encode_body(SaslAuthenticateResponse(error_message="x", auth_bytes=b"v=abc"), 0),
        encode_body(SaslAuthenticateResponse(auth_bytes=b"r=1", session_lifetime_ms=9), 1),
        encode_body(SaslAuthenticateResponse(auth_bytes=b"e=z"), 2),
    ]
    for _ in range(4000):
        version = rng.choice(range(cls.VERSIONS[0], cls.VERSIONS[1] + 1))
        if rng.random() < 0.3:
            data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
        else:
            data = _mutate(rng, rng.choice(samples))
        try:
            msg = decode_body(cls, data, version)
        except ProtocolError:
            continue
        assert decode_body(cls, encode_body(msg, version), version) == msg


def test_scram_parsers_seeded() -> None:
    rng = random.Random(SEED)
    seeds = [_valid_server_first(), b"v=" + base64.b64encode(b"x" * 32), b"e=invalid-proof"]
    for _ in range(20_000):
        data = _mutate(rng, rng.choice(seeds))
        for parse in (parse_server_first, parse_server_final):
            with contextlib.suppress(*ALLOWED):
                parse(data)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=120).map(lambda t: t.encode()))
def test_scram_client_takes_any_server_message(data: bytes) -> None:
    c = ScramClient("SCRAM-SHA-256", "user", "pw", nonce=NONCE)
    c.first()
    try:
        c.final(data)
    except ALLOWED:
        return
    with contextlib.suppress(*ALLOWED):  # accepted: the final message is checked as strictly
        c.verify(data)


@settings(max_examples=300, deadline=None)
@given(
    handshake=st.builds(
        SaslHandshakeResponse,
        error_code=st.integers(-(2**15), 2**15 - 1),
        mechanisms=st.lists(st.text(max_size=12), max_size=3),
    ),
    answers=st.lists(
        st.builds(
            SaslAuthenticateResponse,
            error_code=st.sampled_from([0, 0, 0, 58, 34, -1]),
            error_message=st.none() | st.text(max_size=20),
            auth_bytes=st.binary(max_size=80)
            | st.just(_valid_server_first())
            | st.just(b"e=invalid-proof"),
        ),
        max_size=4,
    ),
    mechanism=st.sampled_from(["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]),
)
def test_exchange_takes_any_answers(
    handshake: SaslHandshakeResponse,
    answers: list[SaslAuthenticateResponse],
    mechanism: str,
) -> None:
    ex = SaslExchange(SaslCredentials(mechanism, "u", "p"), OFFERED, "b:1", nonce=NONCE)
    ex.start()
    try:
        step = ex.on_response(handshake)
        for answer in answers:
            if step is None:
                break
            step = ex.on_response(answer)
    except ALLOWED:
        return
