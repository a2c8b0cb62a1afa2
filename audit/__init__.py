"""msgaudit: end-to-end message audit and reconciliation for Kafka pipelines.

This package is the library and the CLI. It must not import Spark or Airflow at module level:
the CLI reaches Spark jobs (package `spark_jobs`) only inside the command that needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["AuditedProducer", "AuditedConsumer", "__version__"]

if TYPE_CHECKING:
    from audit.clients.consumer import AuditedConsumer
    from audit.clients.producer import AuditedProducer


def __getattr__(name: str) -> Any:
    # Lazy, so `import audit.core.config` stays light and free of librdkafka.
    if name == "AuditedProducer":
        from audit.clients.producer import AuditedProducer

        return AuditedProducer
    if name == "AuditedConsumer":
        from audit.clients.consumer import AuditedConsumer

        return AuditedConsumer
    raise AttributeError(name)
