"""The example kind with one bug, for ``python -m harness.conformance`` to find: after each forward it drops the
newest position (an off-by-one a rule of one's own can have), so a head holds one token fewer than its budget
allows. Generation still equals its reference (the reference is what the cache held), so only the check of what an
evicting kind keeps catches it:

    PYTHONPATH=examples python -m harness.conformance mykinds.broken:BrokenRecentKVCache     # exit 1
"""

from mykinds.recent import RecentKVCache


class BrokenRecentKVCache(RecentKVCache):
    kind = "broken_recent"
    description = "recent, with a bug: the newest position is dropped after every forward"

    def _priority(self, layer, probs, k_all, pos_all, t):
        priority, carried = super()._priority(layer, probs, k_all, pos_all, t)
        newest = pos_all.amax(-1, keepdim=True)
        return priority.masked_fill(pos_all == newest, float("-inf")), carried  # the bug: never keeps the newest
