"""Exchange and queue federation (RabbitMQ's ``federation-upstream`` parameters and policies)."""
