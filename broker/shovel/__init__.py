"""Dynamic shovels: RabbitMQ's ``shovel`` runtime parameters, run on the cluster leader.

``definition.py`` validates a parameter's value into a ``ShovelDef``; ``local.py`` (this broker,
through the model's public operations), ``remote.py`` (any AMQP 0-9-1 broker, over aiormq, the
library under aio-pika) and ``http_dest.py`` (LavinMQ's HTTP destination, over aiohttp's client)
are the ends; ``link.py`` moves messages between two ends and keeps its status; ``manager.py``
starts, stops, pauses and restarts the links as the parameters change. See docs/shovels.md.
"""
