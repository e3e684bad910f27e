"""Dynamic shovels: RabbitMQ's ``shovel`` runtime parameters, run on the cluster leader.

``definition.py`` validates a parameter's value into a ``ShovelDef``; ``local.py`` (this broker,
through the model's public operations), ``amqp_source.py`` and ``amqp_dest.py`` (any AMQP 0-9-1
broker, on the connections of the shared link layer ``broker/links/``) and ``http_dest.py``
(LavinMQ's HTTP destination, over aiohttp's client)
are the ends; ``link.py`` moves messages between two ends and keeps its status; ``manager.py``
starts, stops, pauses and restarts the links as the parameters change. See docs/shovels.md.
"""
