"""LMQ's interfaces on Skred: an HTTP queue API (9980) and MessagePack-RPC (18800).

LMQ (seed 002) is a queue used entirely over HTTP and MessagePack-RPC, with visibility timeouts,
retries, accumulation into compound messages and regex fan-out. Here it is a second front end on
the same model as AMQP: its queues are the vhost's queues, a put goes through the one publish
operation (``VHost.publish``), and a take is the queue's own ``get``; so a message put over HTTP
can be consumed over AMQP and the other way round. ``engine`` holds LMQ's semantics, ``props``
its queue properties, ``http_api`` and ``rpc`` the two wire protocols, ``statsd`` the statistics.
"""
