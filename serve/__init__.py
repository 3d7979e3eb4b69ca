"""Serving without Ray: the OpenAI-compatible API shapes, the tier-aware router's index and
scoring, and the Prometheus metrics. The Ray Serve deployment graph that uses them lives in
`actors/serve_graph.py` (every Ray call stays in `actors/`)."""
