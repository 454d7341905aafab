"""The worker as a Ray Serve replica: one engine per replica, and what it reports.

    replica.py         WorkerReplica: the Serve deployment class
    routing_stats.py   the routing-stats record
    routing_report.py  the report built from an engine
    tracing.py         the worker's part of a request's trace
"""
