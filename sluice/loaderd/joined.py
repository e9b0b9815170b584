"""Ring replies of one IO-loop turn, joined into one message per client (docs/protocol.md, "Joined replies").

A client whose GETs say ``joined: true`` (with ``ring: true``) takes several
ring replies (each a BATCH header and its 32-byte ring reference, exactly as
sent alone) back to back in one message. The daemon collects the ring replies
one turn makes (one request handled, or one replica's parked GETs offered
again) per client, and sends each client's at the end of the turn, at most
`MAX_JOINED` a message: one send, one wake-up of libzmq and of the client for
several micro-batches, where each used to be a message of its own.

What did not leave is never a delivery (ROUTER_MANDATORY): a position joined
here is counted as received by its client only once the message holding it
was sent, by the caller of `take`. Memory: at most the positions one turn
serves (each GET's span, each replica's parked GETs), frames of a few hundred
bytes each; `take` empties it.
"""

from __future__ import annotations

from typing import Any

from sluice.wire.ring import MAX_JOINED

__all__ = ["JoinedReplies"]


class JoinedReplies:
    """Per client identity, the ring replies (frames) made this turn and what each one delivers (`position`: the
    caller's record, handed back with its message)."""

    def __init__(self) -> None:
        self._by: dict[bytes, tuple[list[Any], list[Any]]] = {}
        self.messages = 0  # messages made (STATS `joined`)
        self.replies = 0  # ring replies they held: replies / messages is the mean join

    def add(self, identity: bytes, frames: list[Any], position: Any) -> None:
        """Join a ring reply (`frames`: its header and reference) to `identity`'s message of this turn."""
        held = self._by.get(identity)
        if held is None:
            held = self._by[identity] = ([], [])
        held[0].extend(frames)
        held[1].append(position)

    def take(self) -> list[tuple[bytes, list[Any], list[Any]]]:
        """The messages to send, emptied: (identity, frames, positions), at most `MAX_JOINED` replies each, the
        replies of each identity in the order they were added."""
        out = []
        for identity, (frames, positions) in self._by.items():
            per = 2 * MAX_JOINED  # (two frames a reply)
            for i in range(0, len(positions), MAX_JOINED):
                out.append((identity, frames[2 * i:2 * i + per], positions[i:i + MAX_JOINED]))
            self.replies += len(positions)
        self.messages += len(out)
        self._by.clear()
        return out

    def stats(self) -> dict[str, int]:
        return {"messages": self.messages, "replies": self.replies}
