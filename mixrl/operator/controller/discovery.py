"""What the cluster serves, and the build options that follow from it.

API discovery answers whether the Prometheus Operator's PodMonitors and KEDA's ScaledObjects exist
in this cluster; each answer is remembered for ``ttl_s``, so a reconcile costs no discovery call
of its own.  The reconcilers ask here (a call down, like the API client's), never the kopf layer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from mixrl.operator.builders.objects import BuildOptions, Images, Monitoring
from mixrl.operator.kube.client import KubeClient
from mixrl.operator.kube.rbac import PODMONITORS, SCALEDOBJECTS, ApiResource


@dataclass
class Discovery:
    client: KubeClient
    images: Images
    monitoring_mode: str = "auto"
    """``auto`` (PodMonitor when monitoring.coreos.com/v1 serves podmonitors), ``podmonitor`` or
    ``annotations``."""
    keda_mode: str = "auto"
    """``auto`` (ScaledObjects when keda.sh/v1alpha1 serves scaledobjects), ``on`` or ``off``."""
    drain_seconds: int = 300
    ttl_s: float = 300.0
    builtin_autoscaler: bool = True
    """The operator runs its built-in autoscaler (AutoscalerReady of builtin runs says whether)."""
    _served: dict[str, tuple[set[str] | None, float]] = field(default_factory=dict)
    """group/version -> (the plurals it serves, None when it serves nothing; when that was asked)."""

    async def serves(self, resource: ApiResource) -> bool:
        """Whether the cluster serves a resource (API discovery, remembered for ``ttl_s``)."""
        key = f"{resource.group}/{resource.version}"
        now = asyncio.get_running_loop().time()
        known = self._served.get(key)
        if known is None or now - known[1] > self.ttl_s:
            known = (await self.client.served_resources(resource.group, resource.version), now)
            self._served[key] = known
        return known[0] is not None and resource.plural in known[0]

    async def monitoring(self) -> Monitoring:
        if self.monitoring_mode != "auto":
            return Monitoring(self.monitoring_mode)
        return Monitoring.POD_MONITOR if await self.serves(PODMONITORS) else Monitoring.ANNOTATIONS

    async def keda(self) -> bool:
        if self.keda_mode != "auto":
            return self.keda_mode == "on"
        return await self.serves(SCALEDOBJECTS)

    async def options(self) -> BuildOptions:
        """The build options of one reconcile."""
        return BuildOptions(
            images=self.images,
            monitoring=await self.monitoring(),
            drain_seconds=self.drain_seconds,
            keda=await self.keda(),
            keda_off=self.keda_mode == "off",
            builtin_autoscaler=self.builtin_autoscaler,
        )
