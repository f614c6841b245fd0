"""The trajectory store: runs, sessions, turns and rewards in SQL (SQLite by default, Postgres).

The server is its only writer of trajectories; the trainer reads through ``claims`` and only
marks what it consumed. Per-token arrays (token ids, logprobs, versions) are stored packed.
"""
