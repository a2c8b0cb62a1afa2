"""The iceberg sink's config and error lines (docs/design.md §8), its reader through a pyiceberg
catalog, and `msgaudit connect --help`. A real Connect worker running Iceberg's sink connector is
exercised, and audited by its rows' coordinates, by the lab's Connect scenarios
(tests/test_connect_lab.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from audit.core import config as config_mod
from audit.core.config import SinkConfig
from audit.core.errors import ConfigError, InputError


@pytest.mark.unit
def test_iceberg_sink_config_keys_and_their_errors(tmp_path: Path) -> None:
    def sink(**raw: Any) -> SinkConfig:
        cfg = config_mod.from_dict({"topics": {"orders": {"sinks": [{"name": "ice", "format": "iceberg", **raw}]}}},
                                   base=tmp_path)
        return cfg.topic("orders").sinks[0]

    s = sink(warehouse="wh", table="db.orders")
    assert (s.warehouse, s.table, dict(s.catalog)) == (str(tmp_path / "wh"), "db.orders", {})
    s = sink(catalog={"type": "rest", "uri": "http://127.0.0.1:8181"}, table="db.orders")
    assert (s.warehouse, dict(s.catalog)) == (None, {"type": "rest", "uri": "http://127.0.0.1:8181"})
    with pytest.raises(ConfigError, match=r"sinks\[0\]\.table: an iceberg sink needs its table as 'namespace.name'"):
        sink(warehouse="wh", table="orders")
    with pytest.raises(ConfigError, match=r"sinks\[0\]: an iceberg sink needs 'warehouse'"):
        sink(table="db.orders")
    with pytest.raises(ConfigError, match="'warehouse' and 'catalog' are keys of an iceberg sink, not of a delta one"):
        config_mod.from_dict({"topics": {"orders": {"sinks": [
            {"name": "d", "format": "delta", "location": "x", "warehouse": "wh"}]}}}, base=tmp_path)


@pytest.mark.unit
def test_a_missing_iceberg_table_or_unreachable_catalog_is_one_line_naming_the_sink_and_key(tmp_path: Path) -> None:
    from spark_jobs.io.sinks_read import iceberg_table

    missing = SinkConfig(name="ice", format="iceberg", warehouse=str(tmp_path), table="db.orders")
    with pytest.raises(InputError) as e:
        iceberg_table(missing)
    assert str(e.value) == (f"sink 'ice': no Iceberg table 'db.orders' at {tmp_path}/db/orders (has the connector "
                            "committed yet? check sinks[].warehouse and sinks[].table)")
    unreachable = SinkConfig(name="ice", format="iceberg", table="db.orders",
                             catalog={"type": "rest", "uri": "http://127.0.0.1:1"})
    with pytest.raises(InputError, match=r"^sink 'ice': cannot reach its Iceberg catalog: .*\(check sinks\[\]\.catalog\)$"):
        iceberg_table(unreachable)


@pytest.mark.unit
def test_connect_help_has_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    from audit import cli

    with pytest.raises(SystemExit):
        cli.main(["connect", "--help"])
    assert "msgaudit connect start --bootstrap 127.0.0.1:9092" in capsys.readouterr().out


@pytest.mark.spark
def test_iceberg_reader_matches_columns_by_field_id_through_a_pyiceberg_catalog(spark: Any, tmp_path: Path) -> None:
    """A catalog sink (`catalog:`, here pyiceberg's SQL catalog on SQLite): an empty table reads as no
    rows with the table's columns; after a rename and an added column, older files still read under
    the new name and the added column reads null in them."""
    import pyarrow as pa
    from pyiceberg.catalog import load_catalog
    from pyiceberg.schema import Schema
    from pyiceberg.types import LongType, NestedField, StringType

    from spark_jobs.io.sinks_read import read_iceberg

    props = {"type": "sql", "uri": f"sqlite:///{tmp_path / 'catalog.db'}", "warehouse": f"file://{tmp_path / 'wh'}"}
    catalog = load_catalog("lab", **props)  # the SQL catalog keeps its tables under the catalog's name
    props["name"] = "lab"
    catalog.create_namespace("db")
    table = catalog.create_table("db.orders", Schema(NestedField(1, "offset", LongType(), required=False),
                                                    NestedField(2, "item", StringType(), required=False)))
    sink = SinkConfig(name="ice", format="iceberg", table="db.orders", catalog=props)
    empty = read_iceberg(spark, sink)
    assert (empty.columns, empty.count()) == (["offset", "item"], 0)
    table.append(pa.table({"offset": pa.array([0, 1], pa.int64()), "item": ["a", "b"]}))
    with table.update_schema() as update:
        update.rename_column("item", "sku")
        update.add_column("qty", LongType())
    table = catalog.load_table("db.orders")
    table.append(pa.table({"offset": pa.array([2], pa.int64()), "sku": ["c"], "qty": pa.array([5], pa.int64())}))
    rows = read_iceberg(spark, sink).orderBy("offset").collect()
    assert [tuple(r) for r in rows] == [(0, "a", None), (1, "b", None), (2, "c", 5)]
