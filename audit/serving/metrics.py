"""The report store's figures in Prometheus's format (docs/design.md §4.6).

`ReportCollector` is a prometheus_client collector that reads the published results -- the report
store's `audit_partition_report` and `sla_results`, with SQL aggregates as the dashboard reads them
(`audit/serving/dashboard/data.py`) -- at every collection; it recomputes nothing. Three ways out:

* `serve(cfg)`: an HTTP server for `/metrics` (what `msgaudit follow` runs with `metrics.port`);
* `publish(cfg)`: after each reconcile and SLA step, the node_exporter textfile `metrics.textfile`
  and/or a push to the Pushgateway `metrics.pushgateway` (`spark_jobs/pipeline/steps.py`);
* `exposition(cfg)`: the text itself.

Counters sum the `final` report rows only (a provisional row's counts can still change), so they
only grow as windows become final; a rerun of a window replaces its rows and its counts with them.
The gauges describe each topic's newest final window (latency) or newest checked window (SLA).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from audit.core.errors import MsgauditError
from audit.core.vocabulary import FINAL, REPORT_CODE_COLUMNS
from audit.serving.report_store import ReportStore, UtcDateTime
from audit.serving.report_store import partition_report as report_t
from audit.serving.report_store import sla_results as sla_t

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from audit.core.config import Config, MetricsConfig

# (report column, metric name without `_total`, help) of the per-stage message counters.
COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("expected", "msgaudit_messages_expected", "Messages the stage should have, over the final windows"),
    ("delivered", "msgaudit_messages_delivered", "Expected messages the stage has, over the final windows"),
    ("lost", "msgaudit_messages_lost", "Messages lost at the stage (docs/design.md §5.6), over the final windows"),
    ("duplicated", "msgaudit_messages_duplicated", "Extra copies at the stage, over the final windows"),
    ("reordered", "msgaudit_messages_reordered", "Messages out of order at the stage, over the final windows"),
)
ANOMALIES = "msgaudit_anomalies"
FRESHNESS = "msgaudit_window_final_timestamp_seconds"
LATENCY = "msgaudit_latency_seconds"
SLA_OK = "msgaudit_sla_ok"
STORE_UP = "msgaudit_report_store_up"
# quantile label -> report column
QUANTILES: tuple[tuple[str, str], ...] = (("0.5", "latency_p50_ms"), ("0.95", "latency_p95_ms"),
                                          ("0.99", "latency_p99_ms"), ("1", "latency_max_ms"))
METRIC_NAMES: tuple[str, ...] = (*(f"{name}_total" for _, name, _ in COUNTERS), f"{ANOMALIES}_total", FRESHNESS,
                                 LATENCY, SLA_OK, STORE_UP)


class ReportCollector:
    """Reads the report store at every collection (see the module docstring)."""

    def __init__(self, report_store: str, partition_label: bool = False) -> None:
        self.url = report_store
        self.partition_label = partition_label
        self._store: ReportStore | None = None  # one engine for every scrape of a server

    def _connect(self) -> sa.Connection:
        if self._store is None:
            self._store = ReportStore(self.url)
        return self._store.engine.connect()

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def describe(self) -> list[Any]:
        return []  # no describe-time read of the store: registering must not need the database

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            with self._connect() as conn:
                families = list(self._families(conn))
        except (MsgauditError, sa.exc.SQLAlchemyError) as e:
            up = GaugeMetricFamily(STORE_UP, f"1 when the report store was read, 0 when not ({type(e).__name__})")
            up.add_metric([], 0.0)
            yield up
            return
        up = GaugeMetricFamily(STORE_UP, "1 when the report store was read, 0 when not")
        up.add_metric([], 1.0)
        yield from families
        yield up

    def _families(self, conn: sa.Connection) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        r, s = report_t, sla_t
        final = r.c.status == FINAL
        keys = [r.c.topic, r.c.stage] + ([r.c.partition] if self.partition_label else [])
        label_names = ["topic", "stage"] + (["partition"] if self.partition_label else [])
        sums = [sa.func.sum(r.c[col]) for col, _, _ in COUNTERS] + [sa.func.sum(r.c[c]) for c in REPORT_CODE_COLUMNS]
        rows = conn.execute(sa.select(*keys, *sums).where(final).group_by(*keys).order_by(*keys)).all()
        counters = [CounterMetricFamily(name, text, labels=label_names) for _, name, text in COUNTERS]
        anomalies = CounterMetricFamily(ANOMALIES, "Anomaly rows of the final windows, by code (docs/design.md §5)",
                                        labels=[*label_names, "code"])
        for row in rows:
            labels = [str(v) for v in row[:len(keys)]]
            values = row[len(keys):]
            for family, value in zip(counters, values[:len(COUNTERS)], strict=True):
                family.add_metric(labels, float(value or 0))
            for code, value in zip(REPORT_CODE_COLUMNS, values[len(COUNTERS):], strict=True):
                if value is not None:  # null: a code of another stage kind
                    anomalies.add_metric([*labels, code], float(value))
        yield from counters
        yield anomalies

        fresh = GaugeMetricFamily(FRESHNESS, "End of the topic's newest final window, in Unix seconds",
                                  labels=["topic"])
        newest = (sa.select(r.c.topic, sa.func.max(r.c.window_start).label("ws"), sa.func.max(r.c.window_end))
                  .where(final).group_by(r.c.topic).order_by(r.c.topic))
        newest_start: dict[str, Any] = {}
        for topic, ws, we in conn.execute(newest):
            end = UtcDateTime().process_result_value(we, conn.dialect)  # an aggregate: untyped on SQLite
            assert end is not None
            fresh.add_metric([topic], end.timestamp())
            newest_start[topic] = ws
        yield fresh

        latency = GaugeMetricFamily(LATENCY, "Latency from produce time at the stage in the topic's newest final "
                                    "window, its worst partition's (docs/design.md §5.6)",
                                    labels=["topic", "stage", "quantile"])
        if newest_start:
            sub = (sa.select(r.c.topic, sa.func.max(r.c.window_start).label("ws")).where(final)
                   .group_by(r.c.topic).subquery())
            q = (sa.select(r.c.topic, r.c.stage, *[sa.func.max(r.c[col]) for _, col in QUANTILES])
                 .join(sub, sa.and_(sub.c.topic == r.c.topic, sub.c.ws == r.c.window_start))
                 .where(final).group_by(r.c.topic, r.c.stage).order_by(r.c.topic, r.c.stage))
            for topic, stage, *worst in conn.execute(q):
                for (quantile, _), ms in zip(QUANTILES, worst, strict=True):
                    if ms is not None:  # nothing delivered: no latency
                        latency.add_metric([topic, stage, quantile], float(ms) / 1000.0)
        yield latency

        ok = GaugeMetricFamily(SLA_OK, "1 when every partition passed the rule at the stage in the topic's newest "
                               "checked window, 0 when one failed (docs/design.md §7)", labels=["topic", "stage", "rule"])
        sub = sa.select(s.c.topic, sa.func.max(s.c.window_start).label("ws")).group_by(s.c.topic).subquery()
        failed = sa.func.sum(sa.case((s.c.passed, 0), else_=1))
        q = (sa.select(s.c.topic, s.c.stage, s.c.rule, failed)
             .join(sub, sa.and_(sub.c.topic == s.c.topic, sub.c.ws == s.c.window_start))
             .group_by(s.c.topic, s.c.stage, s.c.rule).order_by(s.c.topic, s.c.stage, s.c.rule))
        for topic, stage, rule, n in conn.execute(q):
            ok.add_metric([topic, stage, rule], 0.0 if n else 1.0)
        yield ok


def registry(cfg: Config) -> tuple[CollectorRegistry, ReportCollector]:
    """A registry holding only the report store's collector, and the collector (to close)."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    collector = ReportCollector(cfg.report_store, cfg.metrics.partition_label)
    reg.register(collector)
    return reg, collector


def exposition(cfg: Config) -> str:
    """The metrics in Prometheus's text format."""
    from prometheus_client import generate_latest

    reg, collector = registry(cfg)
    try:
        return generate_latest(reg).decode("utf-8")
    finally:
        collector.close()


def publish(cfg: Config, warn: Callable[[str], None]) -> None:
    """Write the textfile and push to the Pushgateway, as configured. A failure is one line: the
    step's own results are already stored, and the next step writes the figures again."""
    m = cfg.metrics
    if m.textfile is None and m.pushgateway is None:
        return
    reg, collector = registry(cfg)
    try:
        _publish(m, reg, warn)
    finally:
        collector.close()


def _publish(m: MetricsConfig, reg: CollectorRegistry, warn: Callable[[str], None]) -> None:
    if m.textfile is not None:
        from prometheus_client import write_to_textfile

        try:
            m.textfile.parent.mkdir(parents=True, exist_ok=True)
            write_to_textfile(str(m.textfile), reg)
        except OSError as e:
            warn(f"metrics: cannot write {m.textfile}: {e} (check metrics.textfile)")
    if m.pushgateway is not None:
        from prometheus_client import push_to_gateway

        try:
            push_to_gateway(m.pushgateway, job=m.job, registry=reg, timeout=10)
        except OSError as e:
            warn(f"metrics: cannot push to {m.pushgateway}: {e} (is the Pushgateway up? check metrics.pushgateway)")


class Server:
    """`/metrics` served on a daemon thread until `close()`."""

    def __init__(self, cfg: Config) -> None:
        from prometheus_client import start_http_server

        port = cfg.metrics.port
        if port is None:
            raise ValueError("metrics.port is not set")
        reg, self.collector = registry(cfg)
        try:
            self.httpd, self.thread = start_http_server(port, cfg.metrics.address, reg)
        except OSError as e:
            from audit.core.errors import ConfigError

            raise ConfigError(f"{cfg.source}: metrics.port: cannot listen on {cfg.metrics.address}:{port}: {e} "
                              "(choose a free port)") from None
        self.port = port

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)
        self.collector.close()


def serve(cfg: Config) -> Server | None:
    """The `/metrics` server of `metrics.port`, or None when it is not set."""
    return Server(cfg) if cfg.metrics.port is not None else None
