"""One request's run: its attempts, the path each takes, its stream of chunks, migrations
and resumed streams."""
