"""A Spark DataFrame to Kafka with format("shmprod"): each executor host shares one producer.

python examples/pyspark_write.py [BOOTSTRAP]        # default: an embedded broker
"""

from __future__ import annotations

import sys

import shmprod.spark
from shmprod.broker import EmbeddedBroker


def main(bootstrap: str) -> None:
    spark = shmprod.spark.local_session("local[2]")  # or any session: spark-submit, a cluster
    try:
        shmprod.spark.register(spark)
        df = spark.range(0, 50_000, numPartitions=4).selectExpr(
            "cast(id % 100 as string) AS key", "to_json(named_struct('id', id)) AS value"
        )
        (
            df.write.format("shmprod")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("kafka.compression.type", "lz4")
            .option("topic", "spark-events")
            .option("idleTimeoutMs", "2000")
            .mode("append")
            .save()
        )
        print(f"wrote {df.count():,} rows through format('shmprod')")
    finally:
        shmprod.spark.stop_session(spark)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with EmbeddedBroker() as broker:
            broker.create_topic("spark-events", 4)
            main(broker.bootstrap)
