"""The switch for optimisations that must not change what a client sees."""

from __future__ import annotations


class FastPaths:
    """Publish runs, direct hand-over to a waiting consumer and delivery runs: each must give a
    client exactly what the one-by-one path gives. A vhost owns one switch shared by its queues;
    tests turn it off (``on = False``) to run the same input both ways and compare."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = True
