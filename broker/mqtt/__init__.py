"""MQTT 3.1 and 3.1.1 front end: packets (sans-IO), session (MQTT onto the model), server (asyncio)."""
