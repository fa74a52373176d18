"""Connection budgets for every HTTP server kvbridge runs (side channel, engine API, proxy).

uvicorn closes a keep-alive connection only after a response: a connection that never
sends a byte, or sends its request head a byte at a time (slowloris), stays open for
good, and enough of them fill ``limit_concurrency`` so that every real request gets 503.
The guard wraps uvicorn's HTTP protocol and adds, per connection and per server:

* a deadline for the first byte of a request after the connection is made (after the
  TLS handshake on https);
* a deadline for a complete request head once its first byte arrived, and one for the
  body once the head is complete;
* the keep-alive timeout between requests (uvicorn's own timer, set from the budget);
* a cap on connections: at the cap, the connection idle the longest is closed to make
  room for the new one; if none is idle, the oldest whose request head or body is still
  incomplete. Connections serving a request are never evicted;
* a cap on each request head, in bytes and in header lines (``max_head_bytes``,
  ``max_headers``): 431, counted as the head arrives.

It also bounds the TLS handshake (``GuardedServer``) and gives the heap back after bursts
of closed connections (``heap``). The protocol it wraps is ``kvbridge.bounded_http``'s
(or a subclass: the side channel's), which enforces the head cap and stops reading while
the client leaves answers unread or requests wait behind one in progress.

    budget = ConnectionBudget.load()  # kvbridge/settings: flags, environment, defaults
    uvicorn.Config(app, **guarded_config("api", budget))  # or, for a protocol of one's own:
    uvicorn.Config(app, http=guarded_protocol(BoundedHttpTools, budget, "api"),
                   timeout_keep_alive=budget.keep_alive_timeout)

Modules (each imports only the ones above it in this list):

* ``heap``         freed memory given back after bursts of closed connections
* ``connections``  each server's connections and the counts of every guard of the process
* ``metrics``      those counts for Prometheus
* ``protocol``     the guarded uvicorn protocol and server
"""

from kvbridge.guard.connections import ConnectionGuard, GuardMirror, guard_stats
from kvbridge.guard.metrics import GuardCollector
from kvbridge.guard.protocol import PEER_CERT, GuardedServer, guarded_config, guarded_protocol
from kvbridge.settings import ConnectionBudget

__all__ = [
    "PEER_CERT",
    "ConnectionBudget",
    "ConnectionGuard",
    "GuardCollector",
    "GuardMirror",
    "GuardedServer",
    "guard_stats",
    "guarded_config",
    "guarded_protocol",
]
