"""The RabbitMQ Stream protocol (port 5552/5551) on the model: codec, session, listener."""
