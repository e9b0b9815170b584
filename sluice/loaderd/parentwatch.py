"""An embedded daemon stops when the trainer that started it dies (kill -9, an OOM kill).

Two mechanisms, both set up by `sluice.client.embedded.EmbeddedDaemon`:

* Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``, called
  through ctypes at the daemon's start): the kernel sends SIGTERM, which the
  daemon answers as any SIGTERM (drain, close the node cache, exit 0 within
  2 s). The signal follows the parent *thread*, not the process: it fires
  when the thread that forked the daemon exits. So the trainer asks for it
  (``--parent-death-signal``) only when it starts the daemon from its main
  thread, whose end is the process's end.
* A pipe (``--parent-fd FD``): the trainer holds the only write end and never
  writes; the daemon reads its end in a thread, and end-of-file (every write
  end closed: the trainer process is gone, whichever thread started the
  daemon) sets the same stop flag as SIGTERM. Portable, and it also covers
  a trainer that died before the prctl call took effect.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from sluice.errors import SpecError

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_death_signal(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `signum` to this process when its parent thread exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def check_parent_fd(fd: int) -> None:
    """SpecError naming --parent-fd when `fd` is not an open pipe's read end in this process."""
    import stat

    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        raise SpecError(f"loaderd: --parent-fd {fd}: not an open file descriptor ({exc.strerror})") from None
    if not stat.S_ISFIFO(mode):
        raise SpecError(f"loaderd: --parent-fd {fd}: not a pipe (the read end of a pipe whose writer is the trainer)")


def watch_parent_fd(fd: int, stop: threading.Event) -> threading.Thread:
    """Set `stop` once `fd` reads end-of-file (the trainer holding the write end has exited).

    The thread is a daemon thread blocked in read(): the daemon's own exit
    does not wait for it. Bytes written to the pipe are ignored.
    """
    def run() -> None:
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass  # a closed or broken descriptor counts as the writer's end
        if not stop.is_set():
            logging.getLogger("sluice.loaderd").warning(
                "loaderd: the trainer that started this daemon exited (its pipe closed); stopping")
            stop.set()

    t = threading.Thread(target=run, name="loaderd-parent-watch", daemon=True)
    t.start()
    return t
