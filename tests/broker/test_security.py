"""TLS and SASL end to end: the real Producer, the sender process, tansu, and
confluent-kafka reading back with the same security.

TLS and successful SASL go through :class:`SecurityProxy` in front of tansu (tansu 0.6.0
serves no TLS and stores no SCRAM credential, see ARCHITECTURE.md); the refusals are
also checked against tansu itself started with ``--authentication``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import ssl
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from shmprod import Producer
from shmprod.broker import EmbeddedBroker, free_port
from shmprod.config import REDACTED, ProducerConfig
from shmprod.connection import BrokerConnection
from shmprod.errors import AuthenticationError, ConfigError, SslAuthenticationError
from shmprod.sender import lifecycle
from tests.support.certs import CertificateAuthority, Issued
from tests.support.readback import consume_all
from tests.support.security_proxy import SecurityProxy

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]

PASSWORD = "pw-Zq81-not-anywhere"
USERS = {"alice": PASSWORD}
# alice over SASL_PLAINTEXT with SCRAM-SHA-256
ALICE_SCRAM: dict[str, Any] = {
    "security_protocol": "SASL_PLAINTEXT",
    "sasl_mechanism": "SCRAM-SHA-256",
    "sasl_plain_username": "alice",
    "sasl_plain_password": PASSWORD,
}
FAIL_FAST_S = 10.0  # a refusal must reach the caller well within this


@dataclass
class Pki:
    ca: CertificateAuthority
    server: Issued
    other_ca: CertificateAuthority  # trusted by nobody
    wrong_host: Issued  # signed by ca, but for another name


@pytest.fixture(scope="module")
def pki() -> Iterator[Pki]:
    with tempfile.TemporaryDirectory(prefix="shmprod-pki-") as d:
        ca = CertificateAuthority(d)
        other = CertificateAuthority(d, "other CA")
        yield Pki(ca, ca.issue("server"), other, ca.issue("wrong", hosts=("broker.invalid",)))


def server_context(issued: Issued) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(issued.cert, issued.key)
    return ctx


@contextlib.contextmanager
def secured(
    *, tls: Issued | None = None, users: dict[str, str] | None = None
) -> Iterator[tuple[EmbeddedBroker, SecurityProxy]]:
    """tansu behind a proxy on its advertised port that terminates TLS and/or SASL."""
    port = free_port()
    with EmbeddedBroker(advertised_port=port) as broker:
        ctx = server_context(tls) if tls is not None else None
        with SecurityProxy(port, broker.port, ssl_context=ctx, users=users) as proxy:
            yield broker, proxy


def librdkafka_security(options: dict[str, Any]) -> dict[str, Any]:
    """The same security for confluent-kafka, from our options."""
    out: dict[str, Any] = {"security.protocol": options["security_protocol"]}
    if "ssl_cafile" in options:
        out["ssl.ca.location"] = options["ssl_cafile"]
    if "sasl_mechanism" in options:
        out["sasl.mechanism"] = options["sasl_mechanism"]
        out["sasl.username"] = options["sasl_plain_username"]
        out["sasl.password"] = options["sasl_plain_password"]
    return out


def produce_and_check(bootstrap: str, broker: EmbeddedBroker, topic: str, **sec: Any) -> None:
    broker.create_topic(topic, partitions=2)
    n = 300
    with Producer(bootstrap, linger_ms=1, request_timeout_ms=10_000, **sec) as p:
        futures = [
            p.send(topic, f"v{i}".encode(), key=f"k{i}".encode(), partition=i % 2) for i in range(n)
        ]
        batch = p.send_batch(topic, [f"b{i}".encode() for i in range(n)], partitions=[0] * n)
        p.flush(30)
        offsets = [f.result(10).offset for f in futures]
        batch.result(10)
    assert sorted(offsets[0::2]) == list(range(n // 2))
    landed = consume_all(bootstrap, topic, 2, 2 * n, config=librdkafka_security(sec))
    sent = {(i % 2, f"k{i}".encode(), f"v{i}".encode()) for i in range(n)}
    sent |= {(0, None, f"b{i}".encode()) for i in range(n)}
    got = {(r.partition, r.key, r.value) for part in landed.values() for r in part}
    assert got == sent
    assert sum(len(v) for v in landed.values()) == 2 * n
    for part in landed.values():  # record by record, in offset order
        assert [r.offset for r in part] == list(range(len(part)))


# ---------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"])
def test_sasl_plaintext(mechanism: str, topic_name: str) -> None:
    with secured(users=USERS) as (broker, proxy):
        sec = {
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": mechanism,
            "sasl_plain_username": "alice",
            "sasl_plain_password": PASSWORD,
        }
        produce_and_check(broker.bootstrap, broker, topic_name, **sec)
        assert proxy.authenticated >= 2 and proxy.refused == 0  # us, then librdkafka


def test_ssl(pki: Pki, topic_name: str) -> None:
    with secured(tls=pki.server) as (broker, _):
        sec = {"security_protocol": "SSL", "ssl_cafile": pki.ca.cafile}
        produce_and_check(broker.bootstrap, broker, topic_name, **sec)


def test_sasl_ssl_scram_512(pki: Pki, topic_name: str) -> None:
    with secured(tls=pki.server, users=USERS) as (broker, proxy):
        sec = {
            "security_protocol": "SASL_SSL",
            "ssl_cafile": pki.ca.cafile,
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": "alice",
            "sasl_plain_password": PASSWORD,
        }
        produce_and_check(broker.bootstrap, broker, topic_name, **sec)
        assert proxy.authenticated >= 2


def test_blocking_connection_tls_and_sasl(pki: Pki) -> None:
    with secured(tls=pki.server, users=USERS) as (broker, _):
        cfg = ProducerConfig(
            bootstrap_servers=broker.bootstrap,
            security_protocol="SASL_SSL",
            ssl_cafile=pki.ca.cafile,
            sasl_mechanism="SCRAM-SHA-256",
            sasl_plain_username="alice",
            sasl_plain_password=PASSWORD,
        )
        with BrokerConnection.from_config(cfg, broker.host, broker.advertised_port) as conn:
            assert conn.metadata().brokers
        bad = ProducerConfig(**{**cfg.to_wire(), "sasl_plain_password": "nope"})
        with pytest.raises(AuthenticationError, match="SASL_AUTHENTICATION_FAILED"):
            BrokerConnection.from_config(bad, broker.host, broker.advertised_port).connect()


# ---------------------------------------------------------------------------
# Refusals: typed, prompt, final
# ---------------------------------------------------------------------------


def expect_refusal(bootstrap: str, error: type[Exception], match: str, **sec: Any) -> None:
    """``Producer()`` raises ``error`` quickly; its sender is gone (no reconnect loop)."""
    start = time.monotonic()
    with pytest.raises(error, match=match):
        Producer(bootstrap, max_block_ms=60_000, retry_backoff_ms=10, **sec)
    assert time.monotonic() - start < FAIL_FAST_S


def test_wrong_password_through_a_kafka_like_broker() -> None:
    with secured(users=USERS) as (broker, proxy):
        expect_refusal(
            broker.bootstrap,
            AuthenticationError,
            "SASL_AUTHENTICATION_FAILED",
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="SCRAM-SHA-256",
            sasl_plain_username="alice",
            sasl_plain_password="wrong",
        )
        assert proxy.refused == 1  # one attempt, not a loop


def test_refusal_after_start_fails_pending_and_later_sends(topic_name: str) -> None:
    """Credentials revoked while running: the reconnect is refused once, and every send
    fails with AuthenticationError instead of retrying forever."""
    users = dict(USERS)
    with secured(users=users) as (broker, proxy):
        broker.create_topic(topic_name)
        with Producer(broker.bootstrap, retry_backoff_ms=10, **ALICE_SCRAM) as p:
            assert p.send(topic_name, b"before").result(30).offset == 0
            users["alice"] = "rotated"
            proxy.drop_connections()
            start = time.monotonic()
            with pytest.raises(AuthenticationError):
                p.send(topic_name, b"after").result(FAIL_FAST_S)
            assert time.monotonic() - start < FAIL_FAST_S
            with pytest.raises(Exception, match=r"SASL_AUTHENTICATION_FAILED|sender"):
                p.send(topic_name, b"later").result(FAIL_FAST_S)
        assert proxy.refused == 1
        assert p._proc.wait(30) == lifecycle.EXIT_FAILED  # not the bootstrap status


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_tansu_authentication_refuses_scram(mechanism: str) -> None:
    """tansu answers the final SCRAM message with ``e=unknown-user`` (no error code)."""
    with EmbeddedBroker(authentication=True) as broker:
        expect_refusal(
            broker.bootstrap,
            AuthenticationError,
            "unknown-user",
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism=mechanism,
            sasl_plain_username="alice",
            sasl_plain_password=PASSWORD,
        )


def test_tansu_closes_on_plain() -> None:
    with EmbeddedBroker(authentication=True) as broker:
        expect_refusal(
            broker.bootstrap,
            AuthenticationError,
            "closed the connection during SASL PLAIN",
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="PLAIN",
            sasl_plain_username="alice",
            sasl_plain_password=PASSWORD,
        )
        cfg = ProducerConfig(
            bootstrap_servers=broker.bootstrap,
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="PLAIN",
            sasl_plain_username="alice",
            sasl_plain_password=PASSWORD,
        )
        with pytest.raises(AuthenticationError):
            BrokerConnection.from_config(cfg, broker.host, broker.port).connect()


def test_untrusted_certificate(pki: Pki) -> None:
    with secured(tls=pki.server) as (broker, _):
        expect_refusal(
            broker.bootstrap,
            SslAuthenticationError,
            "certificate not trusted",
            security_protocol="SSL",
            ssl_cafile=pki.other_ca.cafile,
        )
        cfg = ProducerConfig(
            bootstrap_servers=broker.bootstrap,
            security_protocol="SSL",
            ssl_cafile=pki.other_ca.cafile,
        )
        with pytest.raises(SslAuthenticationError):
            BrokerConnection.from_config(cfg, broker.host, broker.advertised_port).connect()


def test_wrong_host_name_and_opting_out(pki: Pki, topic_name: str) -> None:
    with secured(tls=pki.wrong_host) as (broker, _):
        expect_refusal(
            broker.bootstrap,
            SslAuthenticationError,
            "certificate not trusted",
            security_protocol="SSL",
            ssl_cafile=pki.ca.cafile,
        )
        broker.create_topic(topic_name)
        with Producer(
            broker.bootstrap,
            security_protocol="SSL",
            ssl_cafile=pki.ca.cafile,
            ssl_check_hostname=False,
        ) as p:
            assert p.send(topic_name, b"x").result(30).offset == 0


def test_client_certificate_is_presented(pki: Pki, topic_name: str) -> None:
    """A listener that requires a client certificate accepts ours (and an encrypted key)."""
    client = pki.ca.issue("client", hosts=("shmprod-client",), client=True, key_password="kpw")
    ctx = server_context(pki.server)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(pki.ca.cafile)
    port = free_port()
    with (
        EmbeddedBroker(advertised_port=port) as broker,
        SecurityProxy(port, broker.port, ssl_context=ctx),
    ):
        broker.create_topic(topic_name)
        with Producer(
            broker.bootstrap,
            security_protocol="SSL",
            ssl_cafile=pki.ca.cafile,
            ssl_certfile=client.cert,
            ssl_keyfile=client.key,
            ssl_password="kpw",
        ) as p:
            assert p.send(topic_name, b"x").result(30).offset == 0
            assert "kpw" not in repr(p.config)
            assert p.handle.config["ssl_password"] == REDACTED


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({"security_protocol": "TLS"}, "security_protocol"),
        ({"security_protocol": "SASL_SSL"}, "sasl_mechanism"),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "GSSAPI"}, "sasl_mechanism"),
        (
            {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN"},
            "sasl_plain_username",
        ),
        (
            {
                "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "PLAIN",
                "sasl_plain_username": "u",
            },
            "sasl_plain_password",
        ),
        ({"ssl_cafile": "/nonexistent/ca.pem"}, "ssl_cafile"),
        ({"ssl_keyfile": __file__}, "ssl_keyfile"),
        ({"ssl_check_hostname": "yes"}, "ssl_check_hostname"),
        ({"sasl_plain_password": 12345}, "sasl_plain_password"),
    ],
)
def test_config_errors_name_the_option(options: dict[str, Any], option: str) -> None:
    with pytest.raises(ConfigError, match=option) as info:
        ProducerConfig(bootstrap_servers="h:1", **options)
    assert "12345" not in str(info.value)


def test_config_java_names_repr_and_worker_view(pki: Pki) -> None:
    cfg = ProducerConfig.from_mapping(
        {
            "bootstrap.servers": "h:1",
            "security.protocol": "sasl_ssl",
            "ssl.ca.location": pki.ca.cafile,
            "ssl.endpoint.identification.algorithm": "",
            "sasl.mechanism": "scram-sha-512",
            "sasl.username": "alice",
            "sasl.password": PASSWORD,
        }
    )
    assert (cfg.security_protocol, cfg.sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-512")
    assert cfg.ssl_check_hostname is False
    assert PASSWORD not in repr(cfg) and "sasl_plain_password=***" in repr(cfg)
    ctx = cfg.ssl_context()
    assert ctx is not None and not ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED
    workers = cfg.for_workers()
    assert workers["sasl_plain_password"] == REDACTED
    assert ProducerConfig(**workers).security_protocol == "SASL_SSL"  # workers rebuild it
    with pytest.raises(ConfigError, match="redacted"):
        ProducerConfig(**workers).sasl_credentials()
    not_pem = ProducerConfig(bootstrap_servers="h:1", security_protocol="SSL", ssl_cafile=__file__)
    with pytest.raises(ConfigError, match="ssl_cafile"):
        not_pem.ssl_context()


# ---------------------------------------------------------------------------
# Credentials never leave the owner and the sender's memory
# ---------------------------------------------------------------------------


def test_password_appears_nowhere(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, topic_name: str
) -> None:
    monkeypatch.setenv("SHMPROD_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("KAFKA_PASSWORD", PASSWORD)  # as in the README's example
    secret = PASSWORD.encode()
    with secured(users=USERS) as (broker, _):
        broker.create_topic(topic_name)
        with Producer(broker.bootstrap, **ALICE_SCRAM) as p:
            p.send(topic_name, b"value").result(30)
            pid = p.sender_pid
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert secret not in f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert secret not in f.read()
            with open(f"/dev/shm/{p.handle.segment.lstrip('/')}", "rb") as f:
                assert secret not in f.read()
            assert secret not in pickle.dumps(p.handle)
            assert PASSWORD not in repr(p.handle) + repr(p.config)
        # A refused attempt logs too: neither may show the password.
        with pytest.raises(AuthenticationError) as info:
            Producer(
                broker.bootstrap,
                security_protocol="SASL_PLAINTEXT",
                sasl_mechanism="PLAIN",
                sasl_plain_username="alice",
                sasl_plain_password=PASSWORD + "x",
            )
        assert PASSWORD not in str(info.value)
    out, err = capfd.readouterr()
    assert "shmprod-sender" in err  # the sender did log (DEBUG)
    assert PASSWORD not in out + err
    assert not os.path.exists(f"/proc/{pid}")


def test_sender_takes_its_spec_on_stdin_only() -> None:
    """An argument is refused with the honest usage line (nothing secret goes on argv)."""
    import subprocess
    import sys

    for args, stdin in (([" {}"], b""), ([], b"not json")):
        done = subprocess.run(
            [sys.executable, "-m", "shmprod.sender", *args],
            input=stdin,
            capture_output=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == lifecycle.EXIT_USAGE
    # nothing on stdin: an owner that stopped before it wrote the spec
    done = subprocess.run(
        [sys.executable, "-m", "shmprod.sender"],
        input=b"",
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == lifecycle.EXIT_USAGE
    assert b"no spec on stdin" in done.stderr
    assert (
        b"< spec.json"
        in subprocess.run(
            [sys.executable, "-m", "shmprod.sender", "x"],
            input=b"",
            capture_output=True,
            timeout=30,
            check=False,
        ).stderr
    )
