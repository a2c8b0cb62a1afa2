"""The rules of docs/design.md §5 on Arrow columns: what every engine runs.

- `audit.oracle` is the rules' plain statement, message by message (the reference, kept readable);
- `kernel` settles the messages of a window, or of one chunk of it: the ordinary ones (one row at
  each tier, where they should be) by vectorised passes, every other one by the oracle;
- `neighbours` holds the checks that need other messages' rows (the order of consumption per
  (group, partition), the log order per (partition, pid), gaps per pid, content duplicates by
  fingerprint), each a function of a table of narrow rows that holds every row it needs;
- `columns` the Arrow and numpy helpers both use.

Nothing here imports pyspark or does I/O: a Spark task calls these functions on the rows it was
handed (`spark_jobs/reconcile/settle.py`), and a small window calls them in the driver.
"""
