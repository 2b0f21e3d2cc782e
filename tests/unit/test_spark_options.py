"""format("shmprod")'s options and columns, checked on the driver (no Spark needed),
and producer options given as text (Java names, as Spark and command lines give them)."""

from __future__ import annotations

import contextlib

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shmprod.config import ProducerConfig, text_options
from shmprod.errors import ConfigError
from shmprod.spark.columns import rows_table
from shmprod.spark.sink import check_schema, parse_options, rows_to_batches

BS = "127.0.0.1:9092"


def test_kafka_options_become_producer_options() -> None:
    opts = parse_options(
        {
            "kafka.bootstrap.servers": BS,
            "kafka.linger.ms": "20",
            "kafka.compression.type": "lz4",
            "kafka.enable.idempotence": "true",
            "kafka.acks": "all",
            "kafka.batch.size": "262144",
            "topic": "events",
            "idletimeoutms": "1500",  # Spark passes option names in lower case
            "includeLineage": "TRUE",
            "checkpointLocation": "/somewhere",  # Spark's own: ignored
        }
    )
    p = opts.producer_options
    assert p == {
        "bootstrap_servers": BS,
        "linger_ms": 20.0,
        "compression_type": "lz4",
        "enable_idempotence": True,
        "acks": "all",
        "batch_size": 262144,
    }
    assert (opts.topic, opts.idle_timeout_ms, opts.include_lineage) == ("events", 1500, True)
    assert opts.timeout_s is None
    assert parse_options({"kafka.bootstrap.servers": BS, "timeoutMs": "2500"}).timeout_s == 2.5
    # one configuration, one cache key; another configuration, another key
    assert opts.key == parse_options({"kafka.bootstrap.servers": BS, **_same()}).key
    assert opts.key != parse_options({"kafka.bootstrap.servers": BS}).key


def _same() -> dict[str, str]:
    return {
        "kafka.linger.ms": "20",
        "kafka.compression.type": "lz4",
        "kafka.enable.idempotence": "true",
        "kafka.acks": "all",
        "kafka.batch.size": "262144",
        "idleTimeoutMs": "1500",
    }


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({}, "kafka.bootstrap.servers' is required"),
        ({"kafka.bootstrap.servers": BS, "includeLinage": "true"}, "did you mean 'includeLineage'"),
        ({"kafka.bootstrap.servers": BS, "kafka.linger.mss": "5"}, "did you mean 'linger.ms'"),
        ({"kafka.bootstrap.servers": BS, "kafka.linger.ms": "soon"}, "must be a number"),
        ({"kafka.bootstrap.servers": BS, "kafka.batch.size": "1e6"}, "must be an integer"),
        ({"kafka.bootstrap.servers": BS, "kafka.compression.type": "rar"}, "compression_type"),
        ({"kafka.bootstrap.servers": BS, "kafka.enable.idempotence": "yes"}, "true or false"),
        ({"kafka.bootstrap.servers": BS, "kafka.key.serializer": "x.Y"}, "cannot be given as text"),
        ({"kafka.bootstrap.servers": BS, "idleTimeoutMs": "-1"}, "idleTimeoutMs' must be >= 0"),
        ({"kafka.bootstrap.servers": BS, "timeoutMs": "0"}, "timeoutMs' must be >= 1"),
        ({"kafka.bootstrap.servers": BS, "includeLineage": "1"}, "true or false"),
        ({"kafka.bootstrap.servers": BS, "topic": " "}, "'topic' is empty"),
        ({"kafka.bootstrap.servers": "nohostport"}, "bootstrap_servers"),
    ],
)
def test_bad_options_are_refused_by_name(options: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_options(options)


def test_sasl_jaas_config_gives_username_and_password() -> None:
    jaas = (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        'username="alice" password="p\\"w;d";'
    )
    got = text_options({"sasl.jaas.config": jaas, "sasl.mechanism": "SCRAM-SHA-256"})
    assert got["sasl_plain_username"] == "alice"
    assert got["sasl_plain_password"] == 'p"w;d'
    with pytest.raises(ConfigError, match="PlainLoginModule and ScramLoginModule") as info:
        text_options({"sasl.jaas.config": "com.sun.security.auth.module.Krb5LoginModule required;"})
    with pytest.raises(ConfigError, match="username") as info:
        text_options({"sasl.jaas.config": 'x.PlainLoginModule required password="secret";'})
    assert "secret" not in str(info.value)  # a password is never echoed
    with pytest.raises(ConfigError, match="already set"):
        text_options({"sasl.jaas.config": jaas, "sasl.username": "bob"})


@given(
    st.dictionaries(
        st.sampled_from(["linger.ms", "batch.size", "acks", "retries", "client.id", "foo.bar"]),
        st.text(max_size=12),
        max_size=4,
    )
)
def test_text_options_never_raise_anything_but_config_error(options: dict[str, str]) -> None:
    with contextlib.suppress(ConfigError):
        ProducerConfig.from_keywords(bootstrap_servers=BS, **text_options(options))


SPARK_TYPES = {
    "value": "binary",
    "key": "string",
    "topic": "string",
    "partition": "int",
    "headers": "array<struct<key:string,value:binary>>",
    "timestamp": "timestamp",
}


def test_columns_are_found_without_regard_to_case_and_others_ignored() -> None:
    fields = [("Value", "string"), ("KEY", "binary"), ("extra", "map<string,int>")]
    cols = check_schema(fields, "t")
    assert (cols.value, cols.key, cols.topic, cols.headers) == ("Value", "KEY", None, None)
    full = check_schema(list(SPARK_TYPES.items()), None)
    assert full.names == list(SPARK_TYPES)
    # the topic option wins over a topic column (as in Spark's sink)
    assert check_schema(list(SPARK_TYPES.items()), "t").topic is None


@pytest.mark.parametrize(
    ("fields", "topic", "match"),
    [
        ([("key", "string")], "t", "needs a 'value' column.*its columns: key"),
        ([("value", "int")], "t", "column 'value' has type int.*string or binary"),
        ([("value", "string"), ("key", "double")], "t", "column 'key' has type double"),
        ([("value", "string"), ("partition", "string")], "t", "'partition' column must be int"),
        ([("value", "string"), ("timestamp", "bigint")], "t", "'timestamp' column must be"),
        ([("value", "string"), ("headers", "array<string>")], "t", "'headers' column must be"),
        ([("value", "string")], None, "set the option 'topic'"),
        ([("value", "string"), ("VALUE", "string")], "t", "two columns named 'value'"),
    ],
)
def test_missing_or_ill_typed_columns_are_refused_by_name(
    fields: list[tuple[str, str]], topic: str | None, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        check_schema(fields, topic)


def test_rows_become_arrow_batches_of_the_sink_columns() -> None:
    import datetime

    class Row(tuple):  # type: ignore[type-arg]
        """Enough of pyspark's Row: a tuple whose items are also found by name."""

        def __new__(cls, **kw: object) -> Row:
            row = super().__new__(cls, tuple(kw.values()))
            row._names = list(kw)  # type: ignore[attr-defined]
            return row

        def __getitem__(self, item: object) -> object:  # type: ignore[override]
            if isinstance(item, str):
                return tuple.__getitem__(self, self._names.index(item))  # type: ignore[attr-defined]
            return tuple.__getitem__(self, item)  # type: ignore[call-overload]

        def asDict(self) -> dict[str, object]:
            return dict(zip(self._names, self, strict=True))  # type: ignore[attr-defined]

    cols = check_schema(
        [("value", "binary"), ("headers", SPARK_TYPES["headers"]), ("timestamp", "timestamp")],
        "t",
    )
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=datetime.UTC)
    rows = [
        Row(value=bytearray(b"v%d" % i), headers=[Row(key="h", value=b"x")], timestamp=when)
        for i in range(5)
    ]
    batches = list(rows_to_batches(rows, cols, chunk_rows=2))
    assert [b.num_rows for b in batches] == [2, 2, 1]
    first = batches[0]
    assert first.column("value").to_pylist() == [b"v0", b"v1"]
    assert first.column("headers").to_pylist()[0] == [{"key": "h", "value": b"x"}]
    assert first.column("timestamp").to_pylist() == [int(when.timestamp() * 1000)] * 2
    assert rows_table(["a"], [(None,), (1,)]).column("a").type == pa.int64()
