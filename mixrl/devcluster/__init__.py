"""The local Kubernetes test bed (``mixrl dev-cluster``): a real control plane and a KWOK GPU fleet."""
