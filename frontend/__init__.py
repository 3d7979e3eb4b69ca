"""The front of serving, without Ray: the OpenAI-compatible API shapes, the tier-aware
router's index and scoring, stall detection, the settings and the Prometheus metrics. It holds
no server: the HTTP routes and the Ray Serve deployment graph that use these pieces live in
`actors/` (actors/serve_ingress.py, actors/serve_graph.py), where every Ray call stays."""
