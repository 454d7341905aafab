"""The engine: one iteration per `step()` (schedule -> execute -> update), and the async
engine the worker replica drives it through.

    core.py            Engine: the step loop over a scheduler and a runner
    async_engine.py    AsyncEngine: the step loop on its own thread, requests from the event loop
    inbox.py           what the event loop asks of the step thread, one queue
    build.py           an Engine from its config (model path, runner, KV sizing)
    request_checks.py  what a request must satisfy at the engine's door
    stats.py           what an engine reports of itself after every step
    step_meters.py     step counters and timings
"""
