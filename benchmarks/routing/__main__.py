"""python -m benchmarks.routing: the routing table (benchmarks/routing/table.py)."""
from benchmarks.routing.table import main

if __name__ == "__main__":
    raise SystemExit(main())
