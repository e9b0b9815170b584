"""`EmbeddedClient`: a `Client` that owns its embedded daemon (embedded.py) and stops it on close.

Its own module so that `embedded_client` can start the daemon before it
imports `Client` (numpy, pyzmq): the two start-ups overlap.
"""

from __future__ import annotations

from typing import Any

from sluice.client.iterator import Client


class EmbeddedClient(Client):
    """A Client that owns its embedded daemon and stops it on close()."""

    daemon: Any  # sluice.client.embedded.EmbeddedDaemon
    prepared: Any = None  # sluice.runprep.Prepared when made by sluice.stream: its manifest, run spec, work folder

    def close(self, *, keep_daemon: bool = False) -> None:
        """Close the client and stop its daemon; with `keep_daemon`, leave the daemon running.

        A kept daemon stays reachable as `self.daemon` (`daemon.client()` attaches
        a new client) and is the caller's to close.
        """
        super().close()
        daemon = getattr(self, "daemon", None)
        if daemon is not None and not keep_daemon:
            daemon.close()
