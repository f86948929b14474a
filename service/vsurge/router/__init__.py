"""`vsurge route`: one OpenAI-compatible endpoint in front of many vSurge models.

Modules, one job each:
- `static`   parse the static YAML file (models and their upstream URLs) and re-read it when it changes;
- `kube`     discover InferenceModels by listing and watching the Kubernetes API; patch their scale;
- `table`    the endpoint table: which upstreams serve which model, fed by the discovery sources;
- `picking`  pick the upstream with the fewest requests in flight (pure), plus the small load tracker;
- `wake`     scale-from-zero: patch the model to one replica and hold the request until it is ready;
- `proxy`    forward one request (retrying refused connections elsewhere), stream the answer back;
- `metrics`  the router's own Prometheus metrics;
- `errors`   OpenAI-shaped error responses;
- `app`      the Starlette app; `cli` the `vsurge route` command line.

Nothing heavy is imported here: `vsurge --help` imports `vsurge.router.cli` to register the command.
"""
