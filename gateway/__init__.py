"""loragate gateway: tenant auth, rate limits, admission and routing in front of engine replicas.

One module per concern (Starlette-style, flat); `app.build_app` only wires them:
- requests: `generate` (a generation request's path), `routes` (models, probes, metrics), `admin` (the
  operator routes and the ops page), `request_context` (the fields the gateway acts on, the forwarded body);
- callers: `tenant_gate` (key -> tenant, suspensions, rate limits), `auth` + `policy` + `policy_schema`
  (tenants, keys, the policy file), `ratelimit` + `redis_limiter` (GCRA requests and token budgets, in
  memory or in Redis);
- engines: `fleet` (the upstream set, what it serves, drains), `engine_kinds` + `discovery` (loragate or
  vLLM engines, listed or found in DNS), `admission` + `breaker` (in-flight caps, the priority queue, affinity,
  circuit breakers), `upstream` + `proxy` (the engines' models, forwarding and streaming with one retry),
  `vllm` (what differs in front of a vLLM server);
- fleet-wide state: `fleet_store` + `redis_client` (what replicas share through Redis; the Redis
  connection and its circuit breaker), `rollout` + `rollback` + `progress` (canary and A/B splits, health
  windows, progressive steps), `overrides` (suspensions, drains), `reload` + `watch` (hot reload, the file
  watcher);
- `telemetry` (Prometheus and OpenTelemetry), `serving` (building and serving the app), `clock`.
Never imports the engine or torch.
"""
