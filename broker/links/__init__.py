"""Outbound links to other brokers, shared by shovels (``broker/shovel/``) and federation links
(``broker/federation/``): what moves a message from one broker into another.

``message.py`` is a message in flight and the words for how it went; ``wire.py`` is one AMQP
0-9-1 client connection (TCP or TLS, the handshake, heartbeats, deliveries read in place, pamqp
for the rest of the spec) and ``open_first`` over a list of URIs; ``acks.py`` settles a
consuming connection's deliveries with coalesced ``multiple`` acks; ``publisher.py`` writes a
turn's publishes at once and reads publisher confirms in place; ``turn.py`` publishes a turn's
messages into this broker through the model's batch operation, with one group-commit wait.
Nothing here knows a shovel's or an upstream's parameters: those layers hand in URIs, names,
windows and callbacks. See docs/architecture.md.
"""
