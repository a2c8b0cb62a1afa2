"""msgaudit: end-to-end message audit and reconciliation for Kafka pipelines.

This package is the library and the CLI. It must not import Spark or Airflow at module level:
the CLI reaches Spark jobs (package `spark_jobs`) only inside the command that needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from audit.core.errors import install_excepthook

__version__ = "0.1.0"
__all__ = ["AuditedProducer", "AuditedConsumer", "__version__"]

if TYPE_CHECKING:
    from audit.clients.consumer import AuditedConsumer
    from audit.clients.producer import AuditedProducer

# A program using the library that lets a MsgauditError escape ends with its one line, not a traceback.
install_excepthook()


def __getattr__(name: str) -> Any:
    # Lazy, so `import audit.core.config` stays light and free of librdkafka.
    if name == "AuditedProducer":
        from audit.clients.producer import AuditedProducer

        return AuditedProducer
    if name == "AuditedConsumer":
        from audit.clients.consumer import AuditedConsumer

        return AuditedConsumer
    raise AttributeError(name)
