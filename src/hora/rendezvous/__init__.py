"""How hora processes find each other: an authenticated key-value store, formed into rounds."""

from hora.rendezvous.auth import new_secret
from hora.rendezvous.client import RendezvousClient
from hora.rendezvous.rounds import Round, StaleRoundError, round_prefix
from hora.rendezvous.server import RendezvousServer
from hora.rendezvous.store import KeyValueStore

__all__ = ["KeyValueStore", "RendezvousClient", "RendezvousServer", "Round", "StaleRoundError", "new_secret",
           "round_prefix"]
