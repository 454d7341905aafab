"""Scheduling: every step a plan from the running and waiting sequences, and every change
to a request after the step.

    scheduler.py       Scheduler: plan a step (decodes first, then prompt chunks), apply its result
    plan.py            SchedulerOutput: the plan the runner executes
    preemption.py      who gives up its place, and when
    bands.py           priority bands and per-key shares of the running slots
    band_prefill.py    short prompt steps for worse bands
    prefill_caps.py    what one prompt chunk may add beyond the token budget
    step_budget.py     the step-time budget (ITL target) priced by worker/costs
    async_scheduler.py AsyncScheduler: plans made and launched ahead while the device works
    requests.py        Requests: the request table, its waits, failures, outputs and aborts
    stop_check.py      when a sequence stops
    step_apply.py      a step's tokens applied to its sequences
"""
