"""``pdlink serve``: a MindIE-compatible management plane over pdlink engines.

A server process hosts one native pdlink engine per local device and exposes MindIE Server's
PD-disaggregation management endpoints (``POST /v1/role/{prefill|decode|flex}``,
``GET /v1/status``, ``GET /v1/config``, health probes, Prometheus ``/metrics``), so a cluster
controller can assign roles and peers at run time. See docs/server.md.

Modules:

* ``config``: MindIE ``config.json`` (ServerConfig, BackendConfig) plus pdlink's
  ``KvTransferConfig`` section; file location, security checks, defaults (imports the stdlib only).
* ``defaults``: the embedded default configuration, documented.
* ``validation``: the role-assignment body rules (stdlib only, and the native ``ANY_CLUSTER`` once a
  body names an ``id``).
* ``errors``: the HTTP status of each engine status code, for pdlink's own endpoints.
* ``node``: engines, the assignment worker, link jobs and the status (numpy + the native core).
* ``tls``: TLS 1.3 contexts (stdlib ``ssl``).
* ``metrics``, ``app``, ``main``: Prometheus, the ASGI routes and the uvicorn runner; these need
  the optional extra ``pdlink[server]`` (Starlette, uvicorn, prometheus-client).

Importing this package imports none of those third-party modules.
"""
