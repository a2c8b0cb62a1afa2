"""msgaudit's Spark jobs. A process that imports them keeps the memory Arrow frees for its next
allocation (`audit.runtime.memory`): set here, before any of them loads pyarrow."""

from audit.runtime.memory import arrow_env

arrow_env()
