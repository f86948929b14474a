"""`vsurge route`: one OpenAI-compatible endpoint in front of many vSurge models, picking a pod per request.

Modules, one job each:
- `static`    parse the static YAML file (models and their upstream URLs) and re-read it when it changes;
- `watching`  list + watch one Kubernetes resource, one thread per namespace (shared by the two below);
- `kube`      discover InferenceModels; patch their scale;
- `slices`    the ready pods of each model's Service, from its EndpointSlices;
- `table`     the endpoint table: models, their backends, their pods, aliases (adapters);
- `loadpoll`  poll each pod's `GET /load`; the latest reports;
- `picking`   load estimation and least-load picking (pure), the in-flight and ejection tracker;
- `hashring`  consistent hashing with bounded loads (pure);
- `prefix`    the prompt's chained block hashes (pure);
- `picker`    the routing policies (least-load, prefix, round-robin, auto) and the prefix index;
- `proxy`     forward one request (retrying once elsewhere before the first byte), stream the answer;
- `tenants`   the API keys file, constant-time key lookup; `ratelimit` the tenants' token buckets;
- `admission` the gate in front of the proxy (401, per-tenant models, 429); `usage` tokens from answers;
- `tracing`   the request spans (OTel GenAI), `traceparent` to the pod;
- `wake`      scale-from-zero: patch the model to one replica and hold the request until it is ready;
- `metrics`   the router's own Prometheus metrics; `errors` OpenAI-shaped error responses;
- `app`       the Starlette app; `config` the settings; `cli` the `vsurge route` command line.

Nothing heavy is imported here: `vsurge --help` imports `vsurge.router.cli` to register the command.
"""
