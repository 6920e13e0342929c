"""dcp-planner runtime: replays a plan on every rank. Imports planner.schema / planner.io only."""
