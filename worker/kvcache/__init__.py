"""The engine's KV beyond its own pool: disaggregation, tiers below the device, KV events.
(The block pool and prefix cache themselves are the top-level `kv` package.)

    connector.py       KV connector: export after prefill, import before admission
    tiers.py           host / disk / shared tiers: where evicted blocks go and come back from
    tier_admission.py  admission through a lower tier
    event_stream.py    a replica's KV events as the router reads them
"""
