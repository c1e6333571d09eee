"""How the producer's linger shapes the publish gate's read-back on the embedded broker
(issue #3 / #4, session 31).

The broker (librdkafka's mock) answers a fetch with one stored batch per partition, found by a
linear scan of the partition's batches (``kafka_broker``, known limit 7). A publish fed from
Spark sends at its source's pace, so a short linger stores batches of one or two records, and
reading them back is quadratic. Per linger, on a fresh broker: send ``--records`` session-like
records at ``--rate`` to a ``--partitions`` topic, read them back with the publish gate's own
``read_published``, then send and read back the same again on top (a topic that already holds
a publish). Prints the timings and writes ``bench/results/publish-readback-<stamp>.json``.

    .venv/bin/python bench/publish_readback_bench.py    # ~2 min
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

from results_file import git_head, write_result

VALUE = json.dumps({"session_id": "x" * 32, "client_id": "client-00", "user_id": "u-000123",
                    "session_start": "2025-03-01T10:00:00", "pageview_count": 7,
                    "landing_url": "/a/b/c", "exit_url": "/d/e", "revenue": "12.5000",
                    "revision": 2}, separators=(",", ":")).encode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--rate", type=int, default=30_000, help="records/s sent")
    parser.add_argument("--partitions", type=int, default=512)
    parser.add_argument("--lingers", default="5,50,100,250",
                        help="linger.ms values, comma-separated")
    args = parser.parse_args(argv)

    from clickstream.config import Config
    from clickstream.io.kafka_broker import EmbeddedBroker
    from clickstream.io.kafka_clients import make_producer
    from clickstream.io.kafka_produce import flush_or_raise, produce_waiting
    from clickstream.quality.checks import read_published, topic_ends

    def paced_send(config: Config, linger_ms: int) -> float:
        producer = make_producer(config, **{"linger.ms": linger_ms})
        started = time.monotonic()
        for sent in range(args.records):
            ahead = sent / args.rate - (time.monotonic() - started)
            if ahead > 0.001:
                producer.poll(ahead)
            produce_waiting(producer, "t", key=uuid.uuid4().hex.encode(), value=VALUE)
            if sent % 1000 == 0:
                producer.poll(0)
        flush_or_raise(producer)
        return time.monotonic() - started

    runs = []
    for linger_ms in (int(v) for v in args.lingers.split(",")):
        with EmbeddedBroker(port=0, topics={"t": args.partitions}) as broker:
            config = Config(kafka_bootstrap_servers=broker.bootstrap_servers)
            for publish in ("on an empty topic", "behind the first publish"):
                since = topic_ends(config, ["t"])
                sent_s = paced_send(config, linger_ms)
                started = time.monotonic()
                keys = len(read_published(config, since)["t"])
                read_s = time.monotonic() - started
                if keys != args.records:
                    raise SystemExit(f"read back {keys:,} keys, not {args.records:,}")
                runs.append({"linger_ms": linger_ms, "publish": publish,
                             "send_s": round(sent_s, 2), "read_back_s": round(read_s, 2)})
                print(f"linger {linger_ms} ms, {publish}: sent in {sent_s:.1f}s, read back "
                      f"{keys:,} keys in {read_s:.1f}s", flush=True)
    result = {"benchmark": "publish gate read-back by linger", "issue": 3,
              "git_head": git_head(),
              "command": " ".join(["bench/publish_readback_bench.py",
                                  *(sys.argv[1:] if argv is None else argv)]),
              "records": args.records, "rate": args.rate, "partitions": args.partitions,
              "runs": runs}
    print(f"wrote {write_result('publish-readback', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
