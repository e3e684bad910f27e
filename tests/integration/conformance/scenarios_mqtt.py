"""MQTT scenarios: what a client sees of connect and auth, QoS flows, retained messages, wills,
sessions, takeover, keepalive and MQTT 5's options, run against Skred and the reference brokers.

Each scenario is a function of an ``MRun`` (``_mqtt_wire``) registered with the MQTT versions it
runs at: 4 (3.1.1) against Skred, mosquitto 2.0 and RabbitMQ 3.10's MQTT plugin, 5 against Skred
and mosquitto (RabbitMQ 3.10 has no MQTT 5). Every name a scenario uses comes from the run
(``r.topic``, ``r.client_id``) so runs never meet.
"""

from __future__ import annotations

from collections.abc import Callable

from ._mqtt_wire import SESSION_EXPIRY, TOPIC_ALIAS, WILL_DELAY, MRun, prop

MScenario = Callable[[MRun], None]
MQTT_SCENARIOS: dict[str, tuple[MScenario, tuple[int, ...]]] = {}
BOTH, V5 = (4, 5), (5,)
NO_LOCAL, RETAIN_AS_PUBLISHED = 4, 8


def scenario(versions: tuple[int, ...] = BOTH) -> Callable[[MScenario], MScenario]:
    def register(fn: MScenario) -> MScenario:
        MQTT_SCENARIOS[fn.__name__] = (fn, versions)
        return fn
    return register


# ------------------------------------------------------------------ connect and auth

@scenario()
def connect_refusals(r: MRun) -> None:
    """Wrong password, unknown user, no user name, an unknown vhost, then a good login."""
    for name, user, password in (("wrong", "guest", "nope"), ("nouser", "nobody", "x"),
                                 ("anonymous", None, None), ("vhost", "novhost:guest", "guest"),
                                 ("good", "guest", "guest")):
        c = r.client(name, user=user, password=password)
        if c.connack[1:2] == ("connack",) and c.connack[3] == 0:
            c.disconnect()
        else:
            c.next()  # the server closes a refused connection (some without a CONNACK)


@scenario((4,))
def connect_unknown_protocol_level(r: MRun) -> None:
    r.client("v6", version=6).next()


@scenario((4,))
def connect_empty_client_id_persistent(r: MRun) -> None:
    """3.1.1: an empty client id needs a clean session (identifier rejected otherwise)."""
    c = r.client("empty", client_id="", clean=False)
    c.next()
    r.client("empty-clean", client_id="").disconnect()


@scenario(V5)
def connect_assigned_client_id(r: MRun) -> None:
    r.client("empty", client_id="").disconnect()


# ------------------------------------------------------------------ QoS flows

@scenario()
def qos_flows(r: MRun) -> None:
    """Subscriptions at QoS 0, 1, 2 each receive publishes at QoS 0, 1, 2 (the lower QoS wins),
    with the publisher's acknowledgement flows."""
    sub, pub = r.client("sub"), r.client("pub")
    for qos in (0, 1, 2):
        sub.subscribe(r.topic(f"s{qos}/#"), qos=qos)
    for qos in (0, 1, 2):
        for sq in (0, 1, 2):
            pub.publish(r.topic(f"s{sq}/p{qos}"), f"m{qos}", qos=qos)
    sub.receive(9)
    sub.disconnect()
    pub.disconnect()


@scenario()
def unsubscribe_stops_delivery(r: MRun) -> None:
    sub, pub = r.client("sub"), r.client("pub")
    sub.subscribe(r.topic("a"), r.topic("b"), qos=1)
    sub.unsubscribe(r.topic("a"))
    pub.publish(r.topic("a"), "to a", qos=1)
    sub.until_marker(pub, r.topic("b"))
    sub.unsubscribe(r.topic("never-subscribed"))
    sub.disconnect()
    pub.disconnect()


@scenario((4,))
def subscribe_invalid_filter(r: MRun) -> None:
    """'#' not last in a filter: a malformed SUBSCRIBE."""
    c = r.client("c")
    c.subscribe(r.topic("a/#/b"))
    c.ping()


@scenario()
def publish_wildcard_topic(r: MRun) -> None:
    """A topic name with a wildcard is a protocol violation: the connection ends."""
    c = r.client("c")
    c.publish(r.topic("a/+"), "x", qos=1)
    c.ping()


# ------------------------------------------------------------------ retained

@scenario()
def retained_exact_wildcard_and_clear(r: MRun) -> None:
    pub = r.client("pub")
    pub.publish(r.topic("dev/1/temp"), "21", qos=1, retain=True)
    pub.publish(r.topic("dev/2/temp"), "19", qos=0, retain=True)
    exact = r.client("exact")
    exact.subscribe(r.topic("dev/1/temp"), qos=1)
    exact.receive(1)
    wild = r.client("wild")
    wild.subscribe(r.topic("dev/+/temp"), qos=1)
    wild.until_marker(pub, r.topic("dev/marker/temp"))
    pub.publish(r.topic("dev/1/temp"), "", qos=1, retain=True)  # clears
    again = r.client("again")
    again.subscribe(r.topic("dev/1/temp"), qos=1)
    again.until_marker(pub, r.topic("dev/1/temp"))
    for c in (pub, exact, wild, again):
        c.disconnect()


@scenario()
def retained_live_delivery_flag(r: MRun) -> None:
    """A retained publish to a present subscriber arrives with retain 0 (3.3.1.3)."""
    sub, pub = r.client("sub"), r.client("pub")
    sub.subscribe(r.topic("live"), qos=1)
    pub.publish(r.topic("live"), "now", qos=1, retain=True)
    sub.receive(1)
    pub.publish(r.topic("live"), "", qos=1, retain=True)
    sub.receive(1)
    sub.disconnect()
    pub.disconnect()


@scenario(V5)
def retain_handling_and_as_published(r: MRun) -> None:
    pub = r.client("pub")
    pub.publish(r.topic("rh"), "kept", qos=1, retain=True)
    never = r.client("never")
    never.subscribe(r.topic("rh"), qos=1, options=2 << 4)  # retain handling 2: none on subscribe
    never.until_marker(pub, r.topic("rh"))
    rap = r.client("rap")
    rap.subscribe(r.topic("rh"), qos=1, options=RETAIN_AS_PUBLISHED)
    rap.receive(1)
    pub.publish(r.topic("rh"), "again", qos=1, retain=True)
    rap.receive(1)  # retain as published: the live copy keeps retain 1
    pub.publish(r.topic("rh"), "", qos=1, retain=True)
    rap.receive(1)
    for c in (pub, never, rap):
        c.disconnect()


# ------------------------------------------------------------------ wills

@scenario()
def will_on_abnormal_end_only(r: MRun) -> None:
    watcher, pub = r.client("watcher"), r.client("pub")
    watcher.subscribe(r.topic("will/#"), qos=1)
    polite = r.client("polite", will=(r.topic("will/polite"), b"gone", 1, False))
    polite.disconnect()
    rude = r.client("rude", will=(r.topic("will/rude"), b"lost", 1, False))
    rude.drop()
    watcher.receive(1)
    watcher.until_marker(pub, r.topic("will/marker"))
    watcher.disconnect()
    pub.disconnect()


@scenario(V5)
def will_delay_cancelled_by_reconnect(r: MRun) -> None:
    watcher, pub = r.client("watcher"), r.client("pub")
    watcher.subscribe(r.topic("will/#"), qos=1)
    session = prop(SESSION_EXPIRY, 60)
    a = r.client("a", clean=False, props=session, will=(r.topic("will/a"), b"late", 1, False),
                 will_props=prop(WILL_DELAY, 30))
    a.drop()
    r.client("a", clean=True).disconnect()  # back within the delay: no will
    watcher.until_marker(pub, r.topic("will/marker"))
    watcher.disconnect()
    pub.disconnect()


# ------------------------------------------------------------------ sessions

@scenario()
def persistent_session_keeps_messages(r: MRun) -> None:
    session = prop(SESSION_EXPIRY, 300) if r.v5 else b""
    a = r.client("a", clean=False, props=session)
    a.subscribe(r.topic("ps/#"), qos=1)
    a.disconnect()
    pub = r.client("pub")
    pub.publish(r.topic("ps/1"), "one", qos=1)
    pub.publish(r.topic("ps/2"), "two", qos=1)
    pub.publish(r.topic("ps/0"), "qos0 while away", qos=0)
    a = r.client("a", clean=False, props=session)
    a.receive(2)
    a.until_marker(pub, r.topic("ps/marker"))
    a.disconnect()
    r.client("a", clean=True).disconnect()  # a clean session discards it
    r.client("a", clean=False, props=session).disconnect()
    r.client("a", clean=True).disconnect()
    pub.disconnect()


@scenario()
def clean_session_has_no_state(r: MRun) -> None:
    a = r.client("a")
    a.subscribe(r.topic("cs"), qos=1)
    a.disconnect()
    pub = r.client("pub")
    pub.publish(r.topic("cs"), "lost", qos=1)
    b = r.client("a")
    b.subscribe(r.topic("cs2"), qos=1)
    b.until_marker(pub, r.topic("cs2"))
    b.disconnect()
    pub.disconnect()


@scenario()
def takeover_closes_the_first(r: MRun) -> None:
    first = r.client("a")
    second = r.client("a")
    first.next()
    second.disconnect()


@scenario()
def keepalive_closes_a_silent_client(r: MRun) -> None:
    c = r.client("silent", keepalive=1)
    # 1.5 x keepalive (3.1.2.10) is when Skred closes; mosquitto's coarse timer takes 1.5-6 s
    c.closed_within(8.0)


@scenario()
def ping(r: MRun) -> None:
    c = r.client("c")
    c.ping()
    c.disconnect()


# ------------------------------------------------------------------ MQTT 5

@scenario(V5)
def v5_reason_codes(r: MRun) -> None:
    """PUBACK and PUBREC say 'no matching subscribers'; UNSUBACK 'no subscription existed'."""
    c = r.client("c")
    c.publish(r.topic("nobody"), "x", qos=1)
    c.publish(r.topic("nobody"), "x", qos=2)
    c.unsubscribe(r.topic("nothing"))
    c.disconnect()


@scenario(V5)
def v5_shared_subscription(r: MRun) -> None:
    a, b, pub = r.client("a"), r.client("b"), r.client("pub")
    a.subscribe(f"$share/g/{r.topic('work')}", qos=1)
    b.subscribe(f"$share/g/{r.topic('work')}", qos=1)
    for i in range(4):
        pub.publish(r.topic("work"), f"job{i}", qos=1)
    got = [a.next(log=False) for _ in range(2)] + [b.next(log=False) for _ in range(2)]
    r.log(("jobs", sorted(rec[3] for rec in got)))
    for c in (a, b, pub):
        c.disconnect()


@scenario(V5)
def v5_topic_alias(r: MRun) -> None:
    sub = r.client("sub")
    sub.subscribe(r.topic("alias/#"), qos=1)
    pub = r.client("pub", props=b"")
    pub.publish(r.topic("alias/x"), "first", qos=1, props=prop(TOPIC_ALIAS, 1))
    pub.publish("", "second", qos=1, props=prop(TOPIC_ALIAS, 1))
    sub.receive(2)
    sub.disconnect()
    pub.disconnect()


@scenario(V5)
def v5_no_local(r: MRun) -> None:
    me, other = r.client("me"), r.client("other")
    me.subscribe(r.topic("nl"), qos=1, options=NO_LOCAL)
    me.publish(r.topic("nl"), "mine", qos=1)
    other.publish(r.topic("nl"), "theirs", qos=1)
    me.receive(1)
    me.disconnect()
    other.disconnect()


@scenario(V5)
def v5_subscription_identifiers(r: MRun) -> None:
    sub, pub = r.client("sub"), r.client("pub")
    sub.subscribe(r.topic("sid/#"), qos=1, sub_id=7)
    sub.subscribe(r.topic("sid/x"), qos=1, sub_id=9)
    pub.publish(r.topic("sid/x"), "both", qos=1)
    sub.until_marker(pub, r.topic("sid/y"))  # one copy with both identifiers, or one per subscription
    sub.disconnect()
    pub.disconnect()


@scenario(V5)
def v5_session_expiry_zero_ends_session(r: MRun) -> None:
    a = r.client("a", clean=False, props=prop(SESSION_EXPIRY, 300))
    a.subscribe(r.topic("se"), qos=1)
    a.disconnect(props=prop(SESSION_EXPIRY, 0))
    r.client("a", clean=False, props=prop(SESSION_EXPIRY, 300)).disconnect()
    r.client("a", clean=True).disconnect()
