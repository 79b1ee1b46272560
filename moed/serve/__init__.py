"""`moectl serve`'s front: one listening socket, N engine workers per model, one copy of the experts.

Modules, one job each: `lifecycle` (startup, serve, drain, stop), `front` (the ASGI
app relaying each request to a worker), `pool` (which worker takes a request, the
bounded wait), `supervisor` (a worker process: started, watched, restarted),
`worker` (the worker process: moed.serve.app's app on a Unix socket),
`metrics` (the front's Prometheus registry). docs/design.md, "Serving", says why.
"""
