// MQTT.js under Node: connect, subscribe at QoS 1, publish QoS 0, 1 and 2 to the subscribed topic
// (MQTT 5 with a user property and a content type), print what arrived as one JSON line and exit.
// Usage: node mqttjs_roundtrip.mjs URL PROTOCOL_VERSION TOPIC_PREFIX
// Driven by tests/integration/test_mqtt_clients.py; every wait is bounded by a deadline.
import mqtt from "mqtt";

const [url, version, prefix] = process.argv.slice(2);
const protocolVersion = Number(version);
const deadline = setTimeout(() => { console.log(JSON.stringify({ error: "timeout", got })); process.exit(2); }, 15000);
const got = [];
const client = mqtt.connect(url, {
  username: "guest", password: "guest", protocolVersion, clean: true, reconnectPeriod: 0,
  clientId: `mqttjs-${protocolVersion}-${Math.random().toString(16).slice(2, 10)}`,
});
client.on("error", (err) => { console.log(JSON.stringify({ error: String(err), got })); process.exit(1); });
client.on("message", (topic, payload, packet) => {
  got.push({ topic, payload: payload.toString(), qos: packet.qos,
             props: protocolVersion === 5 ? { contentType: packet.properties?.contentType,
                                              userProperties: packet.properties?.userProperties } : null });
  if (got.length === 3) {
    clearTimeout(deadline);
    client.end(false, () => { console.log(JSON.stringify({ got })); process.exit(0); });
  }
});
client.on("connect", async () => {
  await client.subscribeAsync(`${prefix}/#`, { qos: 1 });
  for (const qos of [0, 1, 2]) {
    const properties = protocolVersion === 5 ? { contentType: "text/plain", userProperties: { k: `v${qos}` } } : undefined;
    await client.publishAsync(`${prefix}/q${qos}`, `m${qos}`, { qos, properties });
  }
});
