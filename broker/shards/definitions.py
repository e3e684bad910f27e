"""Definitions export and import of a multi-worker node.

Theory of operation
-------------------
Each worker exports what it holds (``broker.http.definitions.export``): the shared state (users,
permissions, topic permissions, global parameters: the node's one copy, the same in every
worker) and its own vhosts with their topology (vhosts, queues, exchanges, bindings, policies,
vhost parameters). The shard map gives each vhost exactly one worker, so the per-vhost lists of
the parts are disjoint: the node's document is the shared keys of one part and the per-vhost
lists of all of them concatenated, then sorted as a single worker sorts them (by vhost, then
name), so export -> wipe -> import -> export still gives the identical document. A part that
is missing (its worker restarting) would make a document without that worker's vhosts, which
an import elsewhere would take for the whole node: the caller answers an error instead.

An import is all or nothing on one worker (``broker.http.definitions``: validated whole, written
down, undone on failure, completed after a crash), not across several. So a document is taken
when every entry that names a vhost (vhosts, permissions, topic permissions, queues, exchanges,
bindings, policies, parameters) names vhosts of one worker: it goes whole to that worker, whose
own import is the all-or-nothing one (users and global parameters are the node's shared files,
which any worker writes). A document whose vhosts span workers is refused (501) before anything
happens: it is imported per vhost (``/api/definitions/{vhost}``) or on a node of one worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from broker.http.aggregate import merge_exports, named_vhosts

__all__ = ["merge_exports", "owners"]  # the merge is shared with the cluster's (http/forward.py)


def owners(doc: Any, owner: Callable[[str], int]) -> set[int]:
    """The workers owning the vhosts ``doc``'s entries name (empty: users and global state only)."""
    return {owner(name) for name in named_vhosts(doc)}
