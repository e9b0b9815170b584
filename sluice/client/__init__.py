"""The training-side client of loaderd: `Client` (iterator, Stateful) and embedded mode.

Importing `Client` pulls in only pyzmq, numpy and sluice's wire format and
errors: no torch (imported lazily on the first batch), pyarrow or tokenizers.
"""

from sluice._lazy import lazy_exports

_EXPORTS = {
    "Client": "sluice.client.iterator",
    "ClientConfig": "sluice.client.config",
    "StreamOptions": "sluice.client.config",
    "Timeouts": "sluice.client.config",
    "DaemonError": "sluice.errors",
    "DaemonTimeout": "sluice.errors",
    "DaemonUnavailable": "sluice.errors",
    "EmbeddedDaemon": "sluice.client.embedded",
    "embedded_client": "sluice.client.embedded",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
