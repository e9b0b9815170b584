"""The training-side client of loaderd: `Client` (iterator, Stateful) and embedded mode.

Importing this package pulls in only pyzmq, numpy and sluice's wire format and
errors: no torch (imported lazily on the first batch), pyarrow or tokenizers.
"""

from sluice.client.checkpoint import CheckpointedData
from sluice.client.embedded import EmbeddedDaemon, embedded_client
from sluice.client.iterator import Client, DaemonError, DaemonUnavailable

__all__ = ["CheckpointedData", "Client", "DaemonError", "DaemonUnavailable", "EmbeddedDaemon", "embedded_client"]
