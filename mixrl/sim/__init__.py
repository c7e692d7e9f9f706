"""Fleet simulators: the autoscaling policy of :mod:`mixrl.operator.autoscaling` on simulated fleets,
beside KEDA's defaults and static provisioning (``mixrl simulate``, ``bench/autoscaling.py``,
``bench/fleet_cost.py``).  The running operator never imports this package."""
