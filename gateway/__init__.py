"""loragate gateway: tenant auth, rate limits, admission and routing in front of engine replicas.

One module per concern (Starlette-style, flat): `app` (the HTTP app and one request's path through it),
`request_context` (body limits and the fields the gateway acts on), `auth` + `policy` + `admin` (tenants,
keys, the policy file and its hot reload), `ratelimit` + `redis_limiter` (GCRA requests and token
budgets, in memory or shared through Redis), `admission` + `breaker` (in-flight caps, the priority queue,
circuit breakers), `upstream` + `proxy` (the engines, their models, forwarding and streaming with one
retry), `routes` (models, probes, metrics), `telemetry` (Prometheus and OpenTelemetry), `serving`
(uvicorn with a graceful drain).
"""
