"""The SLO planner: sizes each model's worker pools ahead of its load, from TTFT / ITL
targets and the step-cost model (worker/costs/), instead of chasing the queue.

    targets.py     SLOTargets (a percentile each) and PlannerSettings
    forecast.py    arrival rate and token mix from cumulative counters: level, trend, season
    queueing.py    Erlang C: the wait percentile of a pool of c servers
    sizing.py      replicas a pool needs for a load within the targets (the cost model's step times)
    budget.py      a GPU budget shared across models by priority
    planner.py     one pool's decision: observe -> forecast over the start-up horizon -> size
    serve_policy.py  the planner as Ray Serve's autoscaling policy (cluster/sim/planner.py: the simulator's)
"""
