"""Shards: the unit of ownership inside a node (and, later, of leadership in a cluster).

``placement`` is the shard map (pure functions); ``supervisor`` the parent process that runs a
node's workers; ``worker`` a worker's side of the control channel (hand-over, shared state);
``control`` the messages on that channel; ``fanout`` the management API answered for the node.
"""
