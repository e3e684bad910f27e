"""Skred: a disk-first AMQP 0-9-1 message broker."""

__version__ = "0.1.0"
