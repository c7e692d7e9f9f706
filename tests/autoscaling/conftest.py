"""Autoscaling tests: the policy, the fleet simulator, the KEDA builder, the PromQL and the loop.

Real: the pure policy and budget allocation, the simulator, the ScaledObject builder (checked against
KEDA's published API through the ``cloudcoil-models-keda`` models when installed), our aiohttp
Prometheus client and Kubernetes calls, a real Prometheus server (the Debian ``prometheus``
package, started here on loopback with a 1 s scrape interval) scraping real HTTP servers on
loopback that expose SGLang's gauges with prometheus-client, and kopf's real engine running our
handlers on the test's event loop.

Stand-ins: the engines are small aiohttp servers whose gauges the test sets (no model behind them:
the loop only reads their metrics); Kubernetes' pod labels (``namespace``, ``pod``) are attached
as static target labels in the Prometheus config, where a cluster's service discovery would; the
API server is kmock's in-memory emulator, which has no scale semantics — it merges what is PATCHed
to ``…/scale`` into the object itself, so our ``{"spec": {"replicas": N}}`` lands on
``.spec.replicas`` as the real API server's ``specReplicasPath`` mapping would put it (the tests
check the request went to ``/scale``); no Deployment controller runs, the tests write
``status.readyReplicas`` themselves.
"""
