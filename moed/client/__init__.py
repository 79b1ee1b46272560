"""The blocking client engines use: `Client`, `ModelHandle`, `Lease`.

Never imports the daemon, gguf, psutil or llama_cpp.

    with Client(socket_path) as c:
        m = c.open_model(path)
        with m.acquire(layer, experts) as lease:
            a = lease.view(expert, "gate")    # read-only numpy uint8 view

Thread safety: one lock serialises the socket, so a Client may be shared by
threads; each request holds it for one round trip.

A daemon restart: the request in flight fails with DaemonUnavailable, the next one
reconnects on its own (`Client(reconnect_s=30.0)`) and re-binds the open models
(moed/client/client.py's docstring has the rules).
"""

from .client import Client, Lease, ModelHandle, default_socket_path
from .segments import Segment

__all__ = ["Client", "Lease", "ModelHandle", "Segment", "default_socket_path"]
