"""loragate gateway: tenant auth, rate limits, admission and routing in front of engine replicas.

One module per concern (Starlette-style, flat): `app` (the HTTP app and one request's path through it),
`request_context` (the fields the gateway acts on, the forwarded body), `auth` + `policy` (tenants, keys,
the policy file), `reload` + `watch` + `admin` (hot reload, the file watcher, the admin routes),
`rollout` (canary and A/B splits, rollback), `ratelimit` + `redis_limiter` + `redis_client` (GCRA requests
and token budgets, in memory or shared through Redis), `admission` + `breaker` (in-flight caps, the
priority queue, circuit breakers), `upstream` + `proxy` (the engines, their models, forwarding and
streaming with one retry), `routes` (models, probes, metrics), `telemetry` (Prometheus and
OpenTelemetry), `serving` (building and serving the app). Never imports the engine or torch.
"""
