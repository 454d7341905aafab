"""The discrete-event simulator (`kvserve simulate`): the real engine, scheduler, KV cache
manager and routing policies on a virtual clock, with the step-cost model of worker/sim as
the device. Nothing in worker/ or router/ imports this package."""
