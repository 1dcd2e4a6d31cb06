"""`DuplicateWindow`: a group that arrives twice is trained once.

Atropos' run-api can hand the same group out again (it forms batches LIFO and counts them all as
steps), and an environment can send a group twice after a retry. Groups are compared by content
(tokens, loss mask, scores), so ids assigned on arrival do not hide a repeat. Only a source that
may resend (`may_resend`: Atropos, a replayed record) has the window: a source that samples its
own groups (builtin, dataset, environment) never repeats one, and two of its groups alike (short
answers, a row drawn again in a later epoch) are two draws, both trained. The window holds the
last `size` groups of this process (it is not checkpointed: a restart may train a pre-restart
group once more, at most once).
"""

from __future__ import annotations

import hashlib
from collections import deque

from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.validation import Rejection, RejectionReason


def content_key(group: RolloutGroup) -> str:
    return hashlib.blake2b(repr((group.tokens, group.loss_mask, group.scores)).encode(), digest_size=16).hexdigest()


class DuplicateWindow:
    def __init__(self, size: int = 4096) -> None:
        self._order: deque[str] = deque()
        self._seen: set[str] = set()
        self.size = size

    def admit(self, group: RolloutGroup) -> Rejection | None:
        """None for a group not seen within the window (now remembered), else the rejection."""
        key = content_key(group)
        if key in self._seen:
            return Rejection(RejectionReason.DUPLICATE, f"same tokens, mask and scores as a group seen before ({key[:12]})")
        self._seen.add(key)
        self._order.append(key)
        if len(self._order) > self.size:
            self._seen.discard(self._order.popleft())
        return None
