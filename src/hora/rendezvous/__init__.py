"""How hora processes find each other: an authenticated key-value store."""

from hora.rendezvous.auth import new_secret
from hora.rendezvous.client import RendezvousClient
from hora.rendezvous.server import RendezvousServer
from hora.rendezvous.store import KeyValueStore

__all__ = ["KeyValueStore", "RendezvousClient", "RendezvousServer", "new_secret"]
