"""moed: serves the routed experts of Mixture-of-Experts models from NVMe through
one locked, shared RAM tier to several inference processes."""

__version__ = "0.1.0"
